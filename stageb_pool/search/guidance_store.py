"""The run directory's guidance: ``guidance.json`` (one mission) and its step snapshots.

The rule search's only writer of guidance files; every write is atomic. The search keeps
the committed guidance in memory and only writes here: ``load`` is for a resume (and the
checks before one), the one time the file is the source of the guidance.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

from ..artifacts import GUIDANCE, SNAPSHOT_PATTERN, SNAPSHOTS_DIR, snapshot_name
from ..stageb.guidance import Guidance, load_guidance, section_of
from .fileio import remove, write_json

_SNAPSHOT = re.compile(SNAPSHOT_PATTERN)


class GuidanceStore:
    """The per-run guidance file ``run_dir/guidance.json`` (one mission) and its snapshots
    ``run_dir/snapshots/guidance-step{NNNN}.json``, named by guidance step so that two runs
    of the same config produce the same names."""

    def __init__(self, run_dir: str | Path, mission: str, retention: int = 5):
        self.run_dir = Path(run_dir)
        self.mission = mission
        self.retention = retention
        self.path = self.run_dir / GUIDANCE.name
        self.snapshot_dir = self.run_dir / SNAPSHOTS_DIR

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self) -> Guidance:
        """The file's guidance: read on resume only."""
        return load_guidance(self.path, self.mission)

    def document(self, g: Guidance) -> dict:
        """The content of ``guidance.json`` for ``g``."""
        return {self.mission: section_of(g)}

    def write(self, g: Guidance) -> None:
        """Atomic: the file holds the old or the new guidance, never a mix."""
        write_json(self.path, self.document(g))

    def snapshots(self) -> list[Path]:
        """Snapshot files, oldest step first: regular files with a snapshot's name only (a
        symbolic link or anything else put there is never pruned). The run refuses a
        ``snapshots`` folder that is a link before it starts (``run_owner.check_folders``)."""
        if not self.snapshot_dir.is_dir() or self.snapshot_dir.is_symlink():
            return []
        found = [(int(m.group(1)), p) for p in self.snapshot_dir.iterdir()
                 if (m := _SNAPSHOT.match(p.name)) and _regular(p)]
        return [p for _, p in sorted(found)]

    def snapshot_and_write(self, old: Guidance | None, new: Guidance) -> Path | None:
        """Snapshot ``old`` (the guidance the file holds now, written by this store) under its
        step, prune to ``retention``, then write ``new`` atomically. The snapshot is ``old``'s
        document, the same bytes as the file it replaces, so the file is not read back.
        Returns the snapshot path (None when there was no ``old``)."""
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
    """A regular file itself (lstat: a symbolic link is not)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False
