"""Every file a run directory holds, named once: ``ARTIFACTS``.

The run directory, the resume state, ``diff`` and the report read this list, so a new
artifact is one entry plus its writer (docs/artifacts.md describes each file). Imports
nothing of the package but its rows.
"""

from __future__ import annotations

import msgspec

from . import artifact_rows as r


class Artifact(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # relative to the run directory
    writer: str  # the module that writes it
    record: type | None = None  # one row (rows=True) or the document
    rows: bool = False  # JSONL, one record per line
    committed: bool = False  # append-only during the search: state.json commits its length
    volatile: tuple[str, ...] = ()  # dotted key paths diff ignores (besides VOLATILE_KEYS)
    volatile_file: bool = False  # diff ignores the file, present or not


# Any JSON key with one of these names, at any depth of any JSON/JSONL artifact: wall clock.
VOLATILE_KEYS = frozenset({"timestamp", "updated_at", "started_at", "finished_at", "elapsed_s", "elapsed_sec"})

# The folders a run writes into; each must be a real folder inside the run (run_owner.check_folders).
SNAPSHOTS_DIR = "snapshots"
ROLLOUTS_DIR = "rollouts"
REFLECTION_DIR = "reflection_cache"
RUN_FOLDERS = (SNAPSHOTS_DIR, ROLLOUTS_DIR, REFLECTION_DIR)

RUN = Artifact(name="run.json", writer="search/run_owner.py (rundir.RunJson)", volatile=(
    # the invocation; where the run was written and its inputs read from (identified by content)
    "invocation", "config.output", "config.stage_a_paths", "config.guidance.path", "config.prompt.profile",
    "config.rule_search.proposer_prompt_path", "config.ticket_filter.exclude_ticket_keys_path",
    "config.stage_b_distillation.log_chatml_path",
    "config.runner.speculate",  # how fast, never what: speculation leaves every result as it is
    # which stageb-pool wrote the run: not a result
    "tool.version", "tool.format"))
# wall time per phase; throughput and restarts per worker
SUMMARY = Artifact(name="summary.json", writer="app/job.py", volatile=("timing", "workers"))
GUIDANCE = Artifact(name="guidance.json", writer="search/guidance_store.py")
STATE = Artifact(name="state.json", writer="search/state.py", volatile=("version", "tool_version"))
HEADROOM = Artifact(name="judge_headroom.json", writer="search/headroom.py")
# The rule search's append-only artifacts, in the order state.json lists their lengths.
CANDIDATES = Artifact(name="rule_candidates.jsonl", writer="search/rule_search.py", record=r.CandidateRow,
                      rows=True, committed=True)
BENCHMARKS = Artifact(name="benchmarks.jsonl", writer="search/rule_search.py", record=r.BenchmarkRow,
                      rows=True, committed=True)
HARD_CASES = Artifact(name="rule_search_hard_cases.jsonl", writer="search/iteration.py, search/audit.py",
                      record=r.HardCaseRow, rows=True, committed=True)
REGRESSIONS = Artifact(name="rule_search_candidate_regressions.jsonl", writer="search/rule_search.py",
                       record=r.RegressionRow, rows=True, committed=True)
PROPOSER_FAILURES = Artifact(name=f"{REFLECTION_DIR}/rule_search_proposer_failures.jsonl",
                             writer="search/iteration.py", record=r.ProposerFailureRow, rows=True, committed=True)
PROPOSER_ANSWERS = Artifact(name=f"{REFLECTION_DIR}/proposer_answers.jsonl", writer="search/iteration.py",
                            record=r.ProposerAnswerRow, rows=True, committed=True)
ITERATIONS = Artifact(name="rule_search_iterations.jsonl", writer="search/rule_search.py", record=r.IterationRow,
                      rows=True, committed=True)
# The baseline audit's.
BASELINE_METRICS = Artifact(name="baseline_metrics.json", writer="search/audit.py", record=r.AuditMetricsDoc)
BASELINE_TICKET_STATS = Artifact(name="baseline_ticket_stats.jsonl", writer="search/audit.py",
                                 record=r.TicketStatsRow, rows=True)
BASELINE_WRONG = Artifact(name="baseline_wrong_cases.jsonl", writer="search/audit.py", record=r.CaseRow, rows=True)
BASELINE_NP = Artifact(name="baseline_np_cases.jsonl", writer="search/audit.py", record=r.CaseRow, rows=True)
BASELINE_NG = Artifact(name="baseline_ng_cases.jsonl", writer="search/audit.py", record=r.CaseRow, rows=True)
BASELINE_STEPS = Artifact(name="baseline_metrics_steps.jsonl", writer="search/audit.py", record=r.AuditStepRow,
                          rows=True)
# Where stage_b_distillation.log_chatml_path does not say otherwise.
DISTILL = Artifact(name="distill_chatml.jsonl", writer="search/distill.py", record=r.DistillRow, rows=True)
# Which worker ran which task when, and the page drawn from it (rebuilt by `stageb-pool report`).
TIMELINE = Artifact(name="pool_timeline.jsonl", writer="app/job.py", rows=True, volatile_file=True)
REPORT = Artifact(name="report.html", writer="app/report_process.py", volatile_file=True)

ARTIFACTS: tuple[Artifact, ...] = (
    RUN, SUMMARY, GUIDANCE, STATE, HEADROOM, CANDIDATES, BENCHMARKS, HARD_CASES, REGRESSIONS, PROPOSER_FAILURES,
    PROPOSER_ANSWERS, ITERATIONS, BASELINE_METRICS, BASELINE_TICKET_STATS, BASELINE_WRONG, BASELINE_NP, BASELINE_NG,
    BASELINE_STEPS, DISTILL, TIMELINE, REPORT,
)
# Files named by a pattern: a snapshot per guidance step (guidance.json's shape) and, with
# output.save_rollouts, a file per rollout (rows: artifact_rows.RolloutRow).
SNAPSHOT_GLOB = "guidance-step*.json"
SNAPSHOT_PATTERN = r"^guidance-step(\d+)\.json$"


def snapshot_name(step: int) -> str:
    """``snapshots/guidance-step{NNNN}.json``: the guidance at ``step``, as guidance.json held it."""
    return f"{SNAPSHOTS_DIR}/guidance-step{step:04d}.json"


def rollouts_name(rollout_id: str) -> str:
    """``rollouts/<rollout_id>.jsonl``; ``/`` in ids such as ``train/it3/cand2`` become ``-``."""
    return f"{ROLLOUTS_DIR}/{rollout_id.replace('/', '-')}.jsonl"


def by_name(name: str) -> Artifact | None:
    """The entry of the file ``name`` (relative to the run directory), None for a file no entry names."""
    return next((a for a in ARTIFACTS if a.name == name), None)


def committed_names() -> tuple[str, ...]:
    """The append-only artifacts whose byte lengths state.json commits, in its order."""
    return tuple(a.name for a in ARTIFACTS if a.committed)
