"""The format of a run directory (run.json ``tool.format``, state.json ``version``), and the one
migration step of a ``--resume`` of another format or version (docs/rule_search.md, "Upgrades")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import msgspec

from .. import __version__
from ..stageb.errors import InputError
from ..stageb.hashing import content_hash

from .settings import RunIdentity

if TYPE_CHECKING:  # state.py imports this module
    from .state import SearchState

# 1: inputs compared by path (refused); 2: by content, no package version recorded (up to
# 0.1.0; its rows changed within the format); 3: the package version recorded.
FORMAT_VERSION = 3

# Formats whose committed iterations a resume redoes (their rows may not be this version's);
# any other format but this one's is refused.
REDONE_FORMATS = frozenset({2})

# Config keys added to the resume identity since format 2, each with a test of whether its
# value computes what the runs before it did (a committed identity may lack such a key).
ADDED_KEYS: dict[str, Callable[[Any], bool]] = {
    # what the line limit selects is in the tickets, which a resume compares by content anyway
    "ingest.max_line_bytes": lambda value: True,
    # the proposer's answer was not held to its schema
    "rule_search.constrain_proposer": lambda value: value is False,
    # a worker had a share of the cores: one thread with as many workers as cores (cpu:2 on CI)
    # and on a GPU; a cpu:1 run on a larger machine had more: its iterations may differ in low bits
    "pool.threads_per_worker": lambda value: value == 1,
    # one proposer call per iteration
    "rule_search.proposer_calls": lambda value: value == 1,
}


def migrate(state: SearchState, identity: RunIdentity, location: str) -> bool:
    """Whether a resume continues the committed ``state`` (at ``location``): True, or False when
    its iterations are redone (``REDONE_FORMATS``). An unreadable format, another config
    (``config_differences``) or other tickets are refused in one line naming the writer."""
    writer = written_by(state.version, state.tool_version)
    upgrade = state.version != FORMAT_VERSION or state.tool_version != __version__
    way_out = (f"; state.json was written by {writer}: start the run again with --overwrite, or resume it with "
               "that version") if upgrade else ""
    if state.version != FORMAT_VERSION and state.version not in REDONE_FORMATS:
        raise InputError(f"cannot resume: state.json was written by {writer}, which stageb-pool {__version__} "
                         f"(state format {FORMAT_VERSION}) cannot continue: start the run again with --overwrite, "
                         "or resume it with that version", location)
    keys = config_differences(state.config_hash, state.config, identity.config)
    if keys:
        raise InputError("cannot resume: the config differs from the interrupted run's at " + ", ".join(keys)
                         + " (input files are compared by content)" + way_out, location)
    if identity.tickets_hash != state.tickets_hash:
        raise InputError("cannot resume: the tickets differ from the interrupted run's (stage_a_paths content or "
                         "ticket_filter changed)" + way_out, location)
    return state.version == FORMAT_VERSION


def redo_warning(state: SearchState) -> str:
    return (f"resume: state.json was written by {written_by(state.version, state.tool_version)}, whose "
            f"{state.iteration} committed iteration(s) may not hold the rows this version writes: they are redone "
            "from the start, so the run ends as an uninterrupted run of this version would")


def written_by(version: int, tool_version: str | None) -> str:
    """The version that wrote a state, for messages (``tool_version`` None: format 2)."""
    if tool_version is None:
        return f"stageb-pool 0.1.0 or earlier (before versions; state format {version})"
    return f"stageb-pool {tool_version} (state format {version})"


def differing_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted key paths where two plain-data documents differ (lists compared whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        out: list[str] = []
        for key in keys:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                # a section on one side only: named by its keys, which a --set can match
                present = new[key] if key in new else old[key]
                out.extend(differing_keys({}, present, path) if isinstance(present, dict) and present else [path])
            else:
                out.extend(differing_keys(old[key], new[key], path))
        return out
    return [] if old == new else [prefix or "<root>"]


def _at(doc: Any, path: list[str]) -> Any:
    for name in path:
        doc = doc.get(name) if isinstance(doc, dict) else None
    return doc


def config_differences(committed_hash: str, committed: dict, config: dict) -> list[str]:
    """The keys where the identity ``config`` differs from the committed one (whose hash is
    ``committed_hash``), a key of ``ADDED_KEYS`` the committed one lacks aside; [] if none."""
    if content_hash(config) == committed_hash:
        return []
    doc = msgspec.json.decode(msgspec.json.encode(config))  # a copy to prune
    for dotted, neutral in ADDED_KEYS.items():
        *parents, key = dotted.split(".")
        old, new = _at(committed, parents), _at(doc, parents)
        if isinstance(new, dict) and key in new and not (isinstance(old, dict) and key in old) and neutral(new[key]):
            del new[key]
            # a section the committed identity lacks whole (``pool``) goes when pruned empty
            for depth in range(len(parents), 0, -1):
                if _at(doc, parents[:depth]) or _at(committed, parents[:depth]) is not None:
                    break
                del _at(doc, parents[:depth - 1])[parents[depth - 1]]
    if content_hash(doc) == committed_hash:
        return []
    return differing_keys(committed, doc) or ["<unknown>"]
