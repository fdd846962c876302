"""The rule search's resume state: ``state.json``, its single commit point, written atomically
at every iteration end (docs/rule_search.md, "Resume and stop"). Nothing read back is trusted:
the state is typed and :func:`validate_state` checks it against the run directory and the inputs
before any worker starts, so a damaged state is a located refusal (exit 2), never a wrong result."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from .. import __version__
from ..artifacts import BENCHMARKS, CANDIDATES, ITERATIONS, STATE, Artifact, committed_names
from ..stageb.errors import InputError
from ..stageb.guidance import parse_section
from ..stageb.ticket_pools import TrainPoolSampler
from . import fileio
from .run_format import FORMAT_VERSION, migrate
from .settings import RuleSearchConfig, RunIdentity

APPEND_ARTIFACTS = committed_names()

# Far above any run (runner.epochs <= 10,000), and an exact integer in JSON readers using doubles.
MAX_COUNT = 2**53
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
StopReason = Literal["epochs", "early_stop"]  # every value RuleSearch writes
# Replaying the sampler costs O(n_train) per iteration; above this many steps only the ranges
# are checked (a run that long is never hand-made for a test, and the rows still bound it).
MAX_REPLAY_STEPS = 50_000_000


class Brief(msgspec.Struct, forbid_unknown_fields=True):
    """``summary.brief`` of a Metrics, as the state keeps it for the summary's baseline."""

    n: Count
    acc: float | None
    fp_rate: float | None
    fn_rate: float | None


class Baseline(msgspec.Struct, forbid_unknown_fields=True):
    """The first iteration's metrics (the summary's ``baseline``)."""

    train: Brief | None
    eval: Brief | None


class Edit(msgspec.Struct, forbid_unknown_fields=True):
    """One accepted edit (the summary's ``edits``); fields in the order they are written."""

    iteration: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    candidate_id: str
    op: str
    relative_error_reduction: float | None
    guidance_step: Count
    guidance_hash: str


class SearchState(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a resumed run needs to continue exactly where the killed one committed
    (``iteration``: completed iterations; ``config``: the identity, to name changed keys)."""

    iteration: Count
    guidance_hash: str
    guidance_step: Count
    guidance: dict[str, Any]  # checked by parse_section in validate_state (the guidance file's rules)
    no_gain: Count
    rejected_ids: list[str]
    sampler: TrainPoolSampler
    config_hash: str
    tickets_hash: str
    artifacts: dict[str, Count]
    config: dict[str, Any]
    stop_reason: StopReason | None = None
    # Facts the final summary needs that a resumed process could not recompute for free.
    first_pool: list[str] = []
    baseline: Baseline | None = None  # set by the first commit, so never written as null
    edits: list[Edit] = []
    # The run's generation counts and the chunks they cover: a resumed run reports the same.
    generations_done: Count = 0
    generations_saved: Count = 0
    chunks_used: list[str] = []
    version: int = FORMAT_VERSION  # the format (FORMAT_VERSION of the version that wrote it)
    tool_version: str | None = None  # the package version that wrote it (write_state); None: before versions


def load_state(run_dir: Path) -> SearchState | None:
    """The committed state of ``run_dir``, or None when no iteration has completed."""
    path = Path(run_dir) / STATE.name
    try:
        return fileio.read_json(path, type=SearchState)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise InputError(f"cannot resume: cannot read the search state ({err.strerror or err})", str(path)) from None
    except msgspec.ValidationError as err:
        message, key = _split_key_path(str(err))
        where = f"{path}: {key}" if key else str(path)
        raise InputError(f"cannot resume: the search state is not one this program wrote ({message})", where) from None
    except msgspec.DecodeError as err:
        raise InputError(f"cannot resume: unreadable search state ({err})", str(path)) from None


def _split_key_path(message: str) -> tuple[str, str]:
    """msgspec's ``Expected `int`, got `str` - at `$.baseline.train``` as message and key path."""
    m = re.match(r"^(.*) - at `\$(.*)`$", message, re.S)
    if not m:
        return message, ""
    return m.group(1), m.group(2).lstrip(".")


def write_state(run_dir: Path, state: SearchState) -> None:
    """Commit ``state``, marked with this version's format and package version."""
    state.version, state.tool_version = FORMAT_VERSION, __version__
    fileio.write_json(Path(run_dir) / STATE.name, state)


def artifact_lengths(run_dir: Path) -> dict[str, int]:
    lengths = {}
    for name in APPEND_ARTIFACTS:
        path = Path(run_dir) / name
        lengths[name] = path.stat().st_size if path.exists() else 0
    return lengths


def truncate_artifacts(run_dir: Path, lengths: dict[str, int]) -> dict[str, int]:
    """Cut every append-only artifact back to its committed length (missing names: 0); returns
    the bytes removed per file. A resumed state's lengths are within their files (``check_resume``)."""
    removed = {}
    for name in APPEND_ARTIFACTS:
        path = Path(run_dir) / name
        want = lengths.get(name, 0)
        have = path.stat().st_size if path.exists() else 0
        if have > want:
            # Rewritten through a temporary file and a rename, never truncated in place: a
            # crash here leaves the old or the cut file, and nothing a hard link shares changes.
            fileio.atomic_write_bytes(path, fileio.read_prefix(path, want))
            removed[name] = have - want
    return removed


def start_sampler(n_train: int, rule_search: RuleSearchConfig, seed: int) -> TrainPoolSampler:
    return TrainPoolSampler.start(n_train, rule_search.train_pool_size, seed, fraction=rule_search.train_pool_fraction)


class ResumePoint(NamedTuple):
    """Where a ``--resume`` of a rule search starts (``check_resume``)."""

    state: SearchState | None  # the committed state (None: no iteration was committed)
    continued: bool  # its iterations are continued; False: the run starts again from the seed


def check_resume(run_dir: Path, identity: RunIdentity, *, train_keys: list[str], start_sampler: TrainPoolSampler,
                 store) -> ResumePoint:
    """The committed state of ``run_dir`` and whether a resume continues it (``migrate``); one it
    continues is validated. Read-only: refuses (InputError) before anything is written."""
    committed = load_state(run_dir)
    if committed is None:
        return ResumePoint(None, continued=False)
    if not migrate(committed, identity, str(Path(run_dir) / STATE.name)):
        return ResumePoint(committed, continued=False)
    validate_state(committed, run_dir, train_keys=train_keys, start_sampler=start_sampler, store=store)
    return ResumePoint(committed, continued=True)


def _check_lengths(state: SearchState, run_dir: Path, location: str) -> None:
    """Every artifact has a committed length, every length is known, within its file and on a
    row boundary (0, or after a newline: cutting there never splices half a row onto the next)."""
    for name in APPEND_ARTIFACTS:
        if name not in state.artifacts:
            raise InputError(f"cannot resume: no committed length for {name}", f"{location}: artifacts.{name}")
    for name, want in state.artifacts.items():
        if name not in APPEND_ARTIFACTS:
            raise InputError(f"cannot resume: unknown artifact {name!r} (known: {', '.join(APPEND_ARTIFACTS)})",
                             f"{location}: artifacts")
        path = Path(run_dir) / name
        try:
            have = path.stat().st_size if path.exists() else 0
            if want > have:
                raise InputError(f"cannot resume: {name} has {have} bytes but state.json committed {want}",
                                 f"{location}: artifacts.{name}")
            if want and fileio.read_prefix(path, want)[-1:] != b"\n":
                raise InputError(f"cannot resume: the committed length {want} of {name} falls inside a row "
                                 "(it must end at a newline)", f"{location}: artifacts.{name}")
        except OSError as err:
            raise InputError(f"cannot resume: cannot read {name}: {err.strerror or err}", str(path)) from None


def _committed_rows(run_dir: Path, artifact: Artifact, length: int) -> list:
    """The rows in the first ``length`` bytes of an artifact, decoded as its record (a row that
    does not decode is refused, naming the file, line and key)."""
    path = Path(run_dir) / artifact.name
    decoder = msgspec.json.Decoder(artifact.record)
    out = []
    data = fileio.read_prefix(path, length) if length else b""
    for number, line in enumerate(data.splitlines(), 1):
        try:
            out.append(decoder.decode(line))
        except msgspec.ValidationError as err:
            message, key = _split_key_path(str(err))
            raise InputError(f"cannot resume: a committed row of {artifact.name} is not one this program wrote "
                             f"({message})", f"{path}:{number}" + (f": {key}" if key else "")) from None
        except msgspec.DecodeError:
            raise InputError(f"cannot resume: a committed row of {artifact.name} is not a JSON object",
                             f"{path}:{number}") from None
    return out


def _check_against_rows(state: SearchState, run_dir: Path, refuse) -> None:
    """What the state says about past iterations (their count, the no-gain streak, baseline,
    edits, rejected candidates) is what their committed rows say."""
    lengths = state.artifacts
    its = _committed_rows(run_dir, ITERATIONS, lengths[ITERATIONS.name])
    if len(its) != state.iteration or [r.iteration for r in its] != list(range(1, len(its) + 1)):
        refuse(f"iteration {state.iteration}, but {ITERATIONS.name} commits {len(its)} iteration rows", "iteration")
    streak = 0
    for r in its:
        streak = 0 if r.decision == "accepted" else streak + 1
    if state.no_gain != streak:
        refuse(f"no_gain {state.no_gain}, but the committed iteration rows end {streak} without an edit", "no_gain")
    if its and msgspec.to_builtins(state.baseline) != its[0].baseline:
        refuse(f"not the baseline of iteration 1 in {ITERATIONS.name}", "baseline")
    bench = _committed_rows(run_dir, BENCHMARKS, lengths[BENCHMARKS.name])
    recorded = [Edit(iteration=r.iteration, candidate_id=r.candidate_id, op=r.op,
                     relative_error_reduction=r.relative_error_reduction, guidance_step=r.guidance_step_after,
                     guidance_hash=r.guidance_hash) for r in bench]
    if state.edits != recorded:
        refuse(f"not the {len(bench)} accepted edits {BENCHMARKS.name} commits", "edits")
    cands = _committed_rows(run_dir, CANDIDATES, lengths[CANDIDATES.name])
    rejected = sorted({r.candidate_id for r in cands if r.decision != "promoted"})
    if state.rejected_ids != rejected:
        refuse(f"not the {len(rejected)} candidates {CANDIDATES.name} commits as not promoted", "rejected_ids")


def _check_sampler(state: SearchState, train_keys: list[str], start: TrainPoolSampler, refuse) -> None:
    """The sampler is the start sampler advanced once per iteration, and the first pool the
    first it drew: a resumed run draws the pools the uninterrupted one would."""
    s = state.sampler
    if s.n_train != len(train_keys):
        refuse(f"n_train {s.n_train}, but the run has {len(train_keys)} train tickets", "sampler.n_train")
    for name, value, top in (("size", s.size, s.n_train), ("cursor", s.cursor, s.n_train),
                             ("wraps", s.wraps, MAX_COUNT)):
        if not 0 <= value <= top:
            refuse(f"{value} is outside 0..{top}", f"sampler.{name}")
    if state.iteration * max(s.n_train, 1) > MAX_REPLAY_STEPS:
        return
    replay = msgspec.structs.replace(start)
    first: list[str] = []
    for i in range(state.iteration):
        pool = [train_keys[k] for k in sorted(replay.next_pool())]
        first = first or pool
    if replay != s:
        refuse(f"not the state the train pools of {state.iteration} iterations leave ({msgspec.to_builtins(replay)})",
               "sampler")
    if state.first_pool != first:
        bad = next((i for i, (a, b) in enumerate(zip(state.first_pool, first)) if a != b), min(len(first), len(state.first_pool)))
        refuse(f"not the first train pool of the run (first difference at item {bad})", f"first_pool[{bad}]")


def validate_state(state: SearchState, run_dir: Path, *, train_keys: list[str], start_sampler: TrainPoolSampler,
                   store) -> None:
    """Refuse (located InputError) a committed state that does not hold together: its counters,
    lengths, ticket keys and guidance (against its hash and step, and ``guidance.json``).
    ``train_keys``: the run's train tickets in train order (the sampler indexes them)."""
    location = str(Path(run_dir) / STATE.name)

    def refuse(message: str, key: str):
        raise InputError(f"cannot resume: {message}", f"{location}: {key}")

    _check_lengths(state, run_dir, location)
    if state.iteration == 0 and (state.first_pool or state.edits or state.baseline is not None):
        refuse("no iteration completed, yet it records iteration results", "iteration")
    if state.iteration > 0 and state.baseline is None:
        refuse("missing (every completed iteration records the baseline)", "baseline")
    known = set(train_keys)
    for i, key in enumerate(state.first_pool):
        if key not in known:
            refuse(f"ticket key {key!r} is not one of the run's train tickets", f"first_pool[{i}]")
    _check_against_rows(state, run_dir, refuse)
    _check_sampler(state, train_keys, start_sampler, refuse)
    try:
        g = parse_section(state.guidance, f"{location}: guidance")
    except InputError as err:
        raise InputError(f"cannot resume: {err.message}", err.location) from None
    if g.hash != state.guidance_hash:
        refuse(f"the guidance's rules hash to {g.hash}, not to the recorded {state.guidance_hash}", "guidance")
    if g.step != state.guidance_step:
        refuse(f"guidance_step {state.guidance_step}, but the guidance is at step {g.step}", "guidance_step")
    if state.edits and (state.edits[-1].guidance_hash, state.edits[-1].guidance_step) != (g.hash, g.step):
        refuse("the guidance is not the one the last accepted edit produced", "guidance")
    if store.exists():
        current = store.load()
        same = current.hash == g.hash and current.step == g.step
        # One step ahead is the window between writing guidance.json and state.json: the
        # resumed run restores the committed guidance and redoes that iteration.
        if not same and current.step != g.step + 1:
            raise InputError(f"cannot resume: guidance.json (step {current.step}, {current.hash}) is neither the "
                             f"committed guidance (step {g.step}, {g.hash}) nor one step after it",
                             str(store.path))
