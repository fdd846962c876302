"""The run directory's guidance file and its step snapshots: the only writer of either."""

from __future__ import annotations

import re
import stat
from pathlib import Path

from ..artifacts import GUIDANCE, SNAPSHOT_PATTERN, SNAPSHOTS_DIR, snapshot_name
from ..stageb.guidance import Guidance, load_guidance, section_of
from .fileio import remove, write_json

_SNAPSHOT = re.compile(SNAPSHOT_PATTERN)


class GuidanceStore:
    """``guidance.json`` (one mission) and its snapshots, named by guidance step (not the clock)
    so that two runs of the same config produce the same names. The search keeps the guidance
    in memory: the file is read only on resume."""

    def __init__(self, run_dir: str | Path, mission: str, retention: int = 5):
        self.run_dir = Path(run_dir)
        self.mission = mission
        self.retention = retention
        self.path = self.run_dir / GUIDANCE.name
        self.snapshot_dir = self.run_dir / SNAPSHOTS_DIR

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self) -> Guidance:
        return load_guidance(self.path, self.mission)

    def document(self, g: Guidance) -> dict:
        return {self.mission: section_of(g)}

    def write(self, g: Guidance) -> None:
        write_json(self.path, self.document(g))

    def snapshots(self) -> list[Path]:
        """Snapshot files, oldest step first: regular files with a snapshot's name only (nothing
        else is ever pruned; a linked ``snapshots`` folder is refused by ``run_owner.check_folders``)."""
        if not self.snapshot_dir.is_dir() or self.snapshot_dir.is_symlink():
            return []
        found = [(int(m.group(1)), p) for p in self.snapshot_dir.iterdir()
                 if (m := _SNAPSHOT.match(p.name)) and _regular(p)]
        return [p for _, p in sorted(found)]

    def snapshot_and_write(self, old: Guidance | None, new: Guidance) -> Path | None:
        """Snapshot ``old`` (what the file holds now) under its step, prune to ``retention``, then
        write ``new``. The snapshot is encoded from ``old``, the same bytes as the file, which
        is not read back. Returns the snapshot path (None: no ``old``)."""
        snapshot = None
        if old is not None:
            snapshot = self.run_dir / snapshot_name(old.step)
            write_json(snapshot, self.document(old))
            self._prune()
        self.write(new)
        return snapshot

    def _prune(self) -> None:
        keep = max(self.retention, 0)
        files = self.snapshots()
        for path in files[: len(files) - keep] if keep else files:
            remove(path)


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False
