"""What a resumed rule search must match: the run's identity, kept in ``state.json``.

A resume must compute exactly what the interrupted run would have, so its identity holds
everything the search's results depend on, and nothing else:

- the resolved config without the keys that do not change a result: ``output`` (where the
  run is written), the ``pool`` timeouts and restarts (``pool.threads_per_worker`` stays: a
  worker's thread count changes low bits), ``runner.epochs`` (the budget: raising
  it extends a run), ``runner.speculate`` (work computed ahead, never different work),
  ``stage_b_distillation.log_chatml_path`` (where the export goes) and
  ``headroom`` (the judge-headroom check only reports; the search never reads it), and the
  sections of the engines the run does not use (``registry.identity_model_section``);
- the inputs by content, never by path, so a data folder may move: the tickets (in run
  order, ``tickets_hash``), and in place of their paths the content of the seed guidance,
  the prompt profile and the proposer prompt (``guidance.path``, ``prompt.profile`` and
  ``rule_search.proposer_prompt_path`` hold ``content:<hash>``). ``stage_a_paths`` and the
  exclusion list's path are left out: what they select is in the tickets.
"""

from __future__ import annotations

from ..engine.registry import identity_model_section
from ..search.settings import RunIdentity
from ..stageb.hashing import content_hash, tickets_hash
from .config import config_document

# Keys whose value does not change what a run computes (see the module docstring).
NOT_IDENTITY = ("output", "pool.task_timeout", "pool.start_timeout", "pool.max_restarts", "pool.stall_warning",
                "pool.connect_timeout", "runner.epochs", "runner.speculate", "stage_b_distillation.log_chatml_path",
                "stage_a_paths", "ticket_filter.exclude_ticket_keys_path", "headroom")


def identity_document(config, *, seed_guidance, profile, proposer_system: str | None) -> dict:
    """The config as a resume compares it: see the module docstring."""
    doc = config_document(config)
    for dotted in NOT_IDENTITY:
        *parents, key = dotted.split(".")
        node = doc
        for name in parents:
            node = node[name]
        node.pop(key, None)
    if doc["model"].get("gpus_per_worker") == 1:
        # One GPU per worker is what every run before GPU groups did: left out, so their
        # identity (and a resume of them) stays the same; any other group size is compared.
        doc["model"].pop("gpus_per_worker")
    doc["model"] = identity_model_section(doc["model"])
    doc["guidance"]["path"] = f"content:{content_hash(seed_guidance)}"
    doc["prompt"]["profile"] = f"content:{content_hash(profile)}"
    doc["rule_search"]["proposer_prompt_path"] = (
        f"content:{content_hash(proposer_system)}" if proposer_system is not None else None)
    return doc


def run_identity(config, inputs) -> RunIdentity:
    """The identity of a rule search on ``inputs`` (plan.load_inputs) with ``config``."""
    doc = identity_document(config, seed_guidance=inputs.seed_guidance, profile=inputs.profile,
                            proposer_system=inputs.proposer_system)
    return RunIdentity(config_hash=content_hash(doc), config=doc, tickets_hash=tickets_hash(inputs.tickets))
