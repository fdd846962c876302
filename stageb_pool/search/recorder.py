"""The rule search's writes into its run directory, and its waits for the runner, each timed
under its phase (volatile: ``summary.json`` ``timing``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from . import fileio
from .rollout import RolloutResult
from .rows import rollout_rows
from .rundir import rollouts_path

PHASES = ("rollout", "proposer", "gate", "io")


class Recorder:
    def __init__(self, run_dir: str | Path, runner):
        self.run_dir = Path(run_dir)
        self.runner = runner
        self.seconds = {name: 0.0 for name in PHASES}

    @contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - t0

    def append(self, name: str, rows: list) -> None:
        if rows:
            with self.phase("io"):
                fileio.append_jsonl(self.run_dir / name, rows)

    def write_jsonl(self, path: Path, rows: list) -> None:
        with self.phase("io"):
            fileio.write_jsonl(path, rows)

    def wait(self, pendings: list, phase: str = "rollout") -> list:
        """The runner's results for ``pendings`` (one gather), timed as ``phase``; with
        ``save_rollouts`` each rollout's texts go to ``rollouts/<name>.jsonl`` (whole files)."""
        with self.phase(phase):
            results = self.runner.wait(pendings)
        if self.runner.save_rollouts:
            with self.phase("io"):
                for result in results:
                    if isinstance(result, RolloutResult):
                        fileio.write_jsonl(rollouts_path(self.run_dir, result.spec_name), rollout_rows(result))
        return results
