"""The rule search's resume state: ``state.json``, written atomically at every iteration end.

``state.json`` is the single commit point of the search. An iteration appends rows to the
JSONL artifacts as it goes, then writes ``guidance.json``, then ``state.json``. A run killed
anywhere in between resumes from the last ``state.json``: every append-only artifact is cut
back to the byte length recorded there (so no partial iteration survives), and
``guidance.json`` is restored from the copy kept in the state if it ran ahead of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from ..stageb.errors import InputError
from ..stageb.ticket_pools import TrainPoolSampler
from . import fileio, rundir
from .settings import RunIdentity

STATE_FILE = "state.json"
STATE_VERSION = 2  # 2: the identity compares inputs by content; the run's generation counts

# Every append-only artifact of the search, relative to the run directory. Their byte
# lengths go into state.json; a resume truncates them back to those lengths.
APPEND_ARTIFACTS = (
    rundir.CANDIDATES, rundir.BENCHMARKS, rundir.HARD_CASES, rundir.REGRESSIONS, rundir.PROPOSER_FAILURES,
    rundir.PROPOSER_ANSWERS, rundir.ITERATIONS,
)


class SearchState(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a resumed run needs to continue exactly where the killed one committed.

    ``iteration`` counts completed iterations. ``guidance`` is the full guidance document
    at that point (restored if ``guidance.json`` ran ahead). ``config`` is the resolved
    config without its ``output`` section, kept to name the keys that changed.
    """

    iteration: int
    guidance_hash: str
    guidance_step: int
    guidance: dict[str, Any]
    no_gain: int
    rejected_ids: list[str]
    sampler: TrainPoolSampler
    config_hash: str
    tickets_hash: str
    artifacts: dict[str, int]
    config: dict[str, Any]
    stop_reason: str | None = None
    # Facts the final summary needs that a resumed process could not recompute for free.
    first_pool: list[str] = []
    baseline: dict[str, Any] = {}
    edits: list[dict[str, Any]] = []
    # The run's generation counts at the commit and the chunks (cache keys) they cover, so a
    # resumed run reports what an uninterrupted one would.
    generations_done: int = 0
    generations_saved: int = 0
    chunks_used: list[str] = []
    version: int = STATE_VERSION


def load_state(run_dir: Path) -> SearchState | None:
    """The committed state of ``run_dir``, or None when no iteration has completed."""
    path = Path(run_dir) / STATE_FILE
    try:
        return fileio.read_json(path, type=SearchState)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise InputError(f"cannot resume: cannot read the search state ({err.strerror or err})", str(path)) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise InputError(f"cannot resume: unreadable search state ({err})", str(path)) from err


def write_state(run_dir: Path, state: SearchState) -> None:
    fileio.write_json(Path(run_dir) / STATE_FILE, state)


def artifact_lengths(run_dir: Path) -> dict[str, int]:
    """Current byte length of every append-only artifact (0 when absent)."""
    lengths = {}
    for name in APPEND_ARTIFACTS:
        path = Path(run_dir) / name
        lengths[name] = path.stat().st_size if path.exists() else 0
    return lengths


def truncate_artifacts(run_dir: Path, lengths: dict[str, int]) -> dict[str, int]:
    """Cut every append-only artifact back to its committed length (missing names: 0).

    Returns the number of bytes removed per file. A file shorter than its committed length
    was damaged outside the program: that is refused rather than silently continued.
    """
    removed = {}
    for name in APPEND_ARTIFACTS:
        path = Path(run_dir) / name
        want = int(lengths.get(name, 0))
        have = path.stat().st_size if path.exists() else 0
        if have < want:
            raise InputError(
                f"cannot resume: {name} has {have} bytes but state.json committed {want}", str(path)
            )
        if have > want:
            # Rewritten through a temporary file and a rename, never truncated in place: a
            # crash here leaves the old or the cut file, and nothing a hard link shares changes.
            fileio.atomic_write_bytes(path, fileio.read_prefix(path, want))
            removed[name] = have - want
    return removed


def differing_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted key paths where two plain-data documents differ (lists compared whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        out: list[str] = []
        for key in keys:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                out.append(path)
            else:
                out.extend(differing_keys(old[key], new[key], path))
        return out
    return [] if old == new else [prefix or "<root>"]


def preflight_resume(run_dir: Path, identity: RunIdentity) -> None:
    """For ``run_job``: refuse a ``--resume`` with a changed config or tickets before the
    pool starts or run.json is rewritten. The search checks again when it starts."""
    committed = load_state(run_dir)
    if committed is not None:
        check_resumable(committed, identity, run_dir=run_dir)


def check_resumable(state: SearchState, identity: RunIdentity, *, run_dir: Path) -> None:
    """Refuse (InputError) a resume whose config or tickets differ from the committed run."""
    location = str(Path(run_dir) / STATE_FILE)
    if state.version != STATE_VERSION:
        raise InputError(f"cannot resume: state.json has version {state.version} (written by another stageb-pool "
                         f"version), this one reads version {STATE_VERSION}: start the run again with --overwrite",
                         location)
    if identity.config_hash != state.config_hash:
        keys = differing_keys(state.config, identity.config) or ["<unknown>"]
        raise InputError(
            "cannot resume: the config differs from the interrupted run's at " + ", ".join(keys)
            + " (input files are compared by content)", location
        )
    if identity.tickets_hash != state.tickets_hash:
        raise InputError(
            "cannot resume: the tickets differ from the interrupted run's (stage_a_paths content or "
            "ticket_filter changed)",
            location,
        )
