"""stageb_pool: Stage-B rule search on N GPUs with a fork-per-GPU worker pool.

The pool (``Pool``) is a reusable layer with no knowledge of Stage-B: a parent process
forks one worker per device and talks to each over a socketpair with length-prefixed
msgspec JSON frames. Everything Stage-B (tickets, guidance, prompts, verdicts, rule
search) runs in the parent; workers only hold a model.
"""

# Bumped with every release whose artifacts or resume state differ (docs/rule_search.md,
# "Upgrades"); run.json and state.json record it (a state.json without one is 0.1.0).
__version__ = "0.2.0"

from .pool import Pool, PoolError, WorkerDied, WorkerError, WorkerTimeout  # noqa: E402

__all__ = ["Pool", "PoolError", "WorkerError", "WorkerDied", "WorkerTimeout", "__version__"]
