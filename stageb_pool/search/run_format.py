"""The format of a run directory, and the one migration step of a ``--resume``: what it does
with a committed run of another format or version.

The format says what run.json, state.json and the artifacts a rule search commits hold. It
changes, with the package version (``stageb_pool.__version__``), whenever one of them changes
shape or content, so a resume knows whether the committed iterations are what this version
would have written (docs/rule_search.md, "Upgrades"). run.json records it as ``tool.format``
and state.json as ``version``, each beside the package version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import msgspec

from .. import __version__
from ..stageb.errors import InputError
from ..stageb.hashing import content_hash

from .settings import RunIdentity

if TYPE_CHECKING:  # state.py imports this module
    from .state import SearchState

# The formats: 1 compared input files by path (refused); 2 by content, and recorded no package
# version (every version up to 0.1.0; its rows changed within the format); 3 records the
# package version in run.json and state.json.
FORMAT_VERSION = 3

# Formats whose committed iterations a resume redoes from the start instead of continuing
# them: their rows may not be the rows this version writes. Any other format but this one's is
# refused.
REDONE_FORMATS = frozenset({2})

# Config keys added to the resume identity since format 2, each with a test of whether its
# value computes what the runs before it did: a committed run whose identity has no such key
# resumes when every such key holds such a value and the rest is the same.
ADDED_KEYS: dict[str, Callable[[Any], bool]] = {
    # what the line limit selects is in the tickets, which a resume compares by content anyway
    "ingest.max_line_bytes": lambda value: True,
    # the proposer's answer was not held to its schema
    "rule_search.constrain_proposer": lambda value: value is False,
    # a worker had a share of the cores: one thread on a run with as many workers as cores
    # (cpu:2 on CI's 2 cores), and on a GPU, where the model computes on the GPU; a cpu:1 run
    # on a larger machine had more, and its resumed iterations may differ in low bits
    "pool.threads_per_worker": lambda value: value == 1,
    # one proposer call per iteration
    "rule_search.proposer_calls": lambda value: value == 1,
}


def migrate(state: SearchState, identity: RunIdentity, location: str) -> bool:
    """The resume of a committed ``state`` (at ``location``) by this version: True when its
    iterations are continued, False when they are redone from the start (a format of
    ``REDONE_FORMATS``, whose rows may not be this version's). Refused (InputError, one line)
    when this version cannot read its format, or when the config or the tickets differ from
    the committed run's (``config_differences``; the keys ``ADDED_KEYS`` names aside), naming
    the version that wrote it and the way out when that is not this one."""
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
    """What a resume says when ``migrate`` has it redo the iterations of ``state``."""
    return (f"resume: state.json was written by {written_by(state.version, state.tool_version)}, whose "
            f"{state.iteration} committed iteration(s) may not hold the rows this version writes: they are redone "
            "from the start, so the run ends as an uninterrupted run of this version would")


def written_by(version: int, tool_version: str | None) -> str:
    """The version that wrote a state of format ``version`` and package version
    ``tool_version`` (None: format 2, which recorded none), for messages."""
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
    """The value at the key path ``path`` of ``doc`` (None where there is none)."""
    for name in path:
        doc = doc.get(name) if isinstance(doc, dict) else None
    return doc


def config_differences(committed_hash: str, committed: dict, config: dict) -> list[str]:
    """The keys where the identity document ``config`` differs from the committed run's
    (``committed``, whose hash is ``committed_hash``); [] when it is the same config. A key
    ``committed`` does not have that ``ADDED_KEYS`` says computes what the runs before it did
    is the same config."""
    if content_hash(config) == committed_hash:
        return []
    doc = msgspec.json.decode(msgspec.json.encode(config))  # a copy to prune
    for dotted, neutral in ADDED_KEYS.items():
        *parents, key = dotted.split(".")
        old, new = _at(committed, parents), _at(doc, parents)
        if isinstance(new, dict) and key in new and not (isinstance(old, dict) and key in old) and neutral(new[key]):
            del new[key]
            # A section the committed run's identity lacks whole (``pool`` before
            # pool.threads_per_worker) goes when the pruning leaves it empty.
            for depth in range(len(parents), 0, -1):
                if _at(doc, parents[:depth]) or _at(committed, parents[:depth]) is not None:
                    break
                del _at(doc, parents[:depth - 1])[parents[depth - 1]]
    if content_hash(doc) == committed_hash:
        return []
    return differing_keys(committed, doc) or ["<unknown>"]
