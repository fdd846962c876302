"""The report's read-side records: the shape of every file the page draws from.

A row file's record is a lenient view of its row record (``artifacts.py``): every field may
be absent (a run of an earlier version lacks fields), but a present field must have its
documented type, so a crafted or damaged file is found while it is decoded, with its file
and line. The few fields a row cannot do without are required. Numbers are ``int | float``:
shown as the file holds them (``1`` and ``1.0`` differ), so a real run's page keeps its bytes.
"""

from __future__ import annotations

import functools
import operator
import types
import typing

import msgspec
from msgspec import UnsetType

from .. import artifacts

Num = int | float


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Unknown fields are ignored: a run of a later version adds fields."""


class Metrics(Record):
    n: int | None = None
    acc: Num | None = None
    fp_rate: Num | None = None
    fn_rate: Num | None = None


class Splits(Record):
    train: Metrics | None = None
    eval: Metrics | None = None


class WorkerStats(Record):
    items: int | None = None
    busy_s: Num | None = None
    rollout_tickets: int | None = None
    tickets_per_s: Num | None = None


class Summary(Record):
    """``summary.json``: search and audit fields together (each mode writes its own)."""

    mode: str | None = None
    mission: str | None = None
    iterations: int | None = None
    stop_reason: str | None = None
    edits_accepted: int | None = None
    baseline: Splits | None = None
    final: Splits | None = None
    metrics: AuditMetrics | None = None
    n_used: int | None = None
    n_dropped_overlength: int | None = None
    workers: dict[str, WorkerStats] | None = None
    # seconds, counts, "resumed": shown as they are; "speculation": its counts
    timing: dict[str, Num | bool | str | None | dict[str, Num | None]] | None = None
    generations_done: int | None = None
    generations_saved: int | None = None


class RunConfig(Record):
    mode: str | None = None


class Invocation(Record):
    started_at: str | None = None
    workers: int | None = None
    gpus: str | None = None


class Tool(Record):
    name: str | None = None
    version: str | None = None


class RunInfo(Record):
    """``run.json``."""

    config: RunConfig | None = None
    invocation: Invocation | None = None
    tool: Tool | None = None


class GuidanceSection(Record):
    step: int | None = None
    experiences: dict[str, str] | None = None


Guidance = dict[str, GuidanceSection]  # guidance.json and snapshots/guidance-step*.json: mission -> section


class BestCandidate(Record):
    candidate_id: str | None = None
    relative_error_reduction: Num | None = None


class HeadroomTicket(Record):
    label: str | None = None
    p_pass: Num | None = None


class LabelCounts(Record):
    pass_: int | None = msgspec.field(default=None, name="pass")
    fail: int | None = None


class Headroom(Record):
    """``judge_headroom.json``."""

    auc: Num | None = None
    min_auc: Num | None = None
    separates: bool | None = None
    tickets: int | None = None
    pass_share: Num | None = None
    labels: LabelCounts | None = None
    mean_p_pass: Num | None = None
    message: str | None = None
    per_ticket: list[HeadroomTicket] | None = None


class TimelineRow(Record):
    """A row of ``pool_timeline.jsonl``."""

    rank: int
    device: str
    start_s: Num
    end_s: Num
    method: str | None = None
    label: str | None = None


def _as_written(tp):
    """A row field's type for reading: a ``float`` takes an int and keeps it one (shown as
    written), and a field that may be unset is simply absent."""
    if tp is float:
        return Num
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return functools.reduce(operator.or_, [_as_written(t) for t in typing.get_args(tp) if t is not UnsetType])
    return tp


def view(entry: artifacts.Artifact, *, required: tuple[str, ...] = (), defaults: dict | None = None,
         kinds: dict | None = None) -> type[Record]:
    """The lenient view of ``entry``'s row record: its fields, each optional (None, or
    ``defaults``) but ``required``; ``kinds`` gives a field the record of its own the page reads."""
    fields = []
    for f in msgspec.structs.fields(entry.record):
        kind = (kinds or {}).get(f.name) or _as_written(f.type)
        fields.append((f.name, kind) if f.name in required else
                      (f.name, kind | None, (defaults or {}).get(f.name)))
    return msgspec.defstruct(entry.record.__name__.removesuffix("Row"), fields, bases=(Record,),
                             module=__name__, kw_only=True, frozen=True)


AuditMetrics = view(artifacts.BASELINE_METRICS)  # also the audit's ``metrics`` in summary.json
Iteration = view(artifacts.ITERATIONS, required=("iteration",),
                 kinds={"baseline": Splits, "best_candidate": BestCandidate})
# d_acc, d_fp_rate absent (a run that wrote none): shown as +0.000; null: "–"
Candidate = view(artifacts.CANDIDATES, required=("iteration",), defaults={"d_acc": 0, "d_fp_rate": 0})
Benchmark = view(artifacts.BENCHMARKS, required=("iteration",))
ProposerAnswer = view(artifacts.PROPOSER_ANSWERS)
ProposerFailure = view(artifacts.PROPOSER_FAILURES, defaults={"stage": "?"})
HardCase = view(artifacts.HARD_CASES, required=("iteration",))
AuditStep = view(artifacts.BASELINE_STEPS, required=("n_done",))
