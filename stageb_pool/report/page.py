"""The report page: a run directory's files (docs/artifacts.md) as one self-contained HTML page.

Drawn from the files alone, never from the code that wrote them, so a report can be rebuilt
for any run: a file that is missing or cannot be read (``files.py``) is named on the page with
what it would have shown. Every text is shown through ``markup.esc``, and the page makes no
request (inline CSS and SVG, no script, a Content Security Policy that forbids loading anything).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter

from .. import artifacts
from .files import RunFiles
from .markup import cards, esc, filled, given, num, section, short, table, verdict
from .records import (AuditMetrics, AuditStep, Benchmark, BestCandidate, Candidate, Guidance, GuidanceSection,
                      HardCase, Headroom, Invocation, Iteration, LabelCounts, Metrics, ProposerAnswer, ProposerFailure,
                      RunInfo, Splits, Summary, TimelineRow, Tool)

# Every report opens so, since the first version: how `report -o` knows a previous report (output.py).
REPORT_OPENING = "<!DOCTYPE html>\n"
REPORT_TITLE = "<title>stageb-pool report: "
HARD_CASES_SHOWN = 12

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#222;margin:0;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}.sub{color:#666;margin:0 0 10px;overflow-wrap:anywhere}
nav a{margin-right:14px;color:#1f5fa8;text-decoration:none}
section{background:#fff;border:1px solid #e3e5e8;border-radius:6px;padding:4px 16px 14px;margin-top:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #e3e5e8;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:18px}.card span{color:#666;font-size:12px}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid #e8e8e8;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5;position:sticky;top:0}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.accepted td{background:#eaf7ea}.ok{color:#1a7f37}.bad{color:#b42318}.muted{color:#777}
.missing{background:#fff8e1;border:1px solid #f0d37a;border-radius:6px;padding:8px 14px;margin-top:12px}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f8fa;padding:6px 8px;border-radius:4px;margin:4px 0}
.del{color:#b42318}.add{color:#1a7f37}svg.chart{display:block;margin:6px 0}
.cm td{width:90px;text-align:center;font-size:15px}
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def render_report(run_dir, charts=None) -> str:
    """Raises ReportError when the directory is not a run; anything a run of another version lacks, or a file that
    cannot be read as what it should hold, is named on the page instead. ``charts``: what draws the charts
    (charts.py, or a stand-in with its functions: chart_cache.py)."""
    files = RunFiles(run_dir)
    charts = charts or load_chart_libraries()
    run = files.json(artifacts.RUN.name, RunInfo, None) or RunInfo()
    summary = files.json(artifacts.SUMMARY.name, Summary,
                         "the final metrics, the cache counts and the per-worker throughput") or Summary()
    mode = summary.mode or (run.config.mode if run.config else None) or "search"
    mission = summary.mission or next(iter(files.json(artifacts.GUIDANCE.name, Guidance, None) or {}), "")
    sections = _search_sections(files, summary, charts) if mode == "search" else _audit_sections(files, summary, charts)
    headroom = files.json(artifacts.HEADROOM.name, Headroom, "the judge-headroom result" if mode == "search" else None)
    if headroom is not None:
        sections.append(("headroom", "Judge headroom", _headroom(headroom, charts)))
    sections.append(("pool", "The pool's work", _pool(files, summary, charts)))
    invocation = run.invocation or Invocation()
    tool = run.tool or Tool()
    sub = " · ".join(esc(x) for x in (f"{mode} run", f"started {given(invocation.started_at, '?')}",
                                       f"{given(invocation.workers, '?')} worker(s) ({given(invocation.gpus, '?')})",
                                       f"{given(tool.name, 'stageb_pool')} {given(tool.version, '')}", files.root))
    nav = "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t, _ in sections)
    files.check_the_rest()
    missing = ""
    if files.missing:
        items = "".join(f"<li><code>{esc(n)}</code> {esc(why)}</li>" for n, why in files.missing)
        missing = (f'<div class="missing"><b>Missing or unreadable files</b> (a run of an earlier version or one that '
                   f'did not finish, or a damaged file); the page shows what the other files hold:<ul>{items}</ul></div>')
    body = "".join(section(a, t, b) for a, t, b in sections)
    return (f'{REPORT_OPENING}<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"{REPORT_TITLE}{esc(mission)}</title><style>{CSS}</style></head>"
            f"<body><main><h1>{esc(mission) or 'stageb-pool run'}</h1><p class=\"sub\">{sub}</p>"
            f"<nav>{nav}</nav>{missing}{body}</main></body></html>\n")


def load_chart_libraries():
    """charts.py, importing matplotlib (seconds) the first time; a process may call it ahead of
    a render. MPLCONFIGDIR is a temporary folder meanwhile: the font cache matplotlib writes
    stays out of the user's ~/.cache and ~/.config (a report writes its page and nothing else),
    and no matplotlibrc of the user's changes the charts."""
    fonts = logging.getLogger("matplotlib.font_manager")  # "generated new fontManager" (INFO) on every report
    with tempfile.TemporaryDirectory(prefix="stageb-report-matplotlib-") as folder:
        before, level = os.environ.get("MPLCONFIGDIR"), fonts.level
        os.environ["MPLCONFIGDIR"] = folder
        fonts.setLevel(logging.WARNING)
        try:
            from . import charts
        finally:
            fonts.setLevel(level)
            if before is None:
                del os.environ["MPLCONFIGDIR"]
            else:
                os.environ["MPLCONFIGDIR"] = before
    return charts


def _metric_line(m: Metrics | None) -> str:
    m = filled(m)
    return "–" if m is None else f"{num(m.acc)} (fp {num(m.fp_rate)}, n={esc(m.n)})"


def _split(splits: Splits | None, split: str) -> Metrics | None:
    return getattr(splits, split) if splits is not None else None


def _change(base: Splits | None, final: Splits | None, split: str, key: str) -> str:
    """A metric's baseline → final ("–" where one is not measured)."""
    return " → ".join(num(getattr(_split(s, split), key, None)) for s in (base, final))


def _chart_metrics(m: Metrics | None) -> dict | None:
    """A split's metrics as the charts take them (None: not measured)."""
    m = filled(m)
    return None if m is None else {"acc": m.acc, "fp_rate": m.fp_rate}


def _search_sections(files: RunFiles, summary: Summary, charts) -> list:
    iterations = files.jsonl(artifacts.ITERATIONS.name, Iteration, "per-iteration metrics, gate decisions and "
                             f"proposer outcomes (drawn from {artifacts.CANDIDATES.name} instead, where it can)")
    candidates = files.jsonl(artifacts.CANDIDATES.name, Candidate, None) or []  # absent: no candidate was evaluated
    benchmarks = files.jsonl(artifacts.BENCHMARKS.name, Benchmark, None) or []  # absent: no edit was accepted
    base, final = summary.baseline, summary.final
    overview = cards([("iterations", num(summary.iterations)), ("stop reason", esc(summary.stop_reason)),
                      ("edits accepted", num(given(summary.edits_accepted, len(benchmarks)))),
                      ("train accuracy: baseline → final", _change(base, final, "train", "acc")),
                      ("eval accuracy: baseline → final", _change(base, final, "eval", "acc")),
                      ("eval fp_rate: baseline → final", _change(base, final, "eval", "fp_rate"))])
    out = [("overview", "Overview", overview + table(["", "baseline", "final"], [
        [split, _metric_line(_split(base, split)), _metric_line(_split(final, split))] for split in ("train", "eval")]))]
    points, accepted = _iteration_points(iterations, candidates, benchmarks, final)
    body = charts.metrics_per_iteration(points, accepted) if points else "<p>No iteration finished.</p>"
    if iterations is None:
        body += f'<p class="muted">From {artifacts.CANDIDATES.name}: iterations without candidates are not shown; ' \
                'train fp_rate on the tickets baseline and candidate share.</p>'
    else:
        body += _iteration_table(iterations)
    out.append(("iterations", "Metrics per iteration", body))
    out.append(("candidates", "Candidates and the gate", _candidates(candidates, charts)))
    out.append(("guidance", "Guidance as it evolved", _guidance(files, benchmarks)))
    out.append(("proposer", "Proposer", _proposer(files, iterations)))
    hard = [r for r in files.jsonl(artifacts.HARD_CASES.name, HardCase, None) or []  # absent: no confident error
            if r.sampler == "train"]
    if hard:
        last = max(r.iteration for r in hard)
        out.append(("hard", f"Hardest cases (iteration {last})",
                    _hard_cases([r for r in hard if r.iteration == last])))
    return out


def _iteration_points(iterations: list[Iteration] | None, candidates: list[Candidate], benchmarks: list[Benchmark],
                      final: Splits | None):
    if iterations is not None:
        points = [{"x": r.iteration, "tick": str(r.iteration), "train": _chart_metrics(_split(r.baseline, "train")),
                   "eval": _chart_metrics(_split(r.baseline, "eval"))} for r in iterations]
        accepted = [r.iteration for r in iterations if r.decision == "accepted"]
    else:
        first: dict[int, Candidate] = {}
        for c in candidates:
            first.setdefault(c.iteration, c)
        points = [{"x": it, "tick": str(it), "train": {"acc": c.base_acc, "fp_rate": c.base_fp_rate},
                   "eval": {"acc": c.eval_base_acc}} for it, c in sorted(first.items())]
        accepted = sorted({b.iteration for b in benchmarks})
    train, eval_ = _chart_metrics(_split(final, "train")), _chart_metrics(_split(final, "eval"))
    if points and (train or eval_):
        points.append({"x": points[-1]["x"] + 1, "tick": "final", "train": train, "eval": eval_})
    return points, accepted


def _iteration_table(iterations: list[Iteration]) -> str:
    rows, classes = [], []
    for r in iterations:
        rejected = ", ".join(f"{k} {v}" for k, v in (r.candidates_rejected or {}).items())
        best = r.best_candidate or BestCandidate()
        rows.append([num(r.iteration), num(r.guidance_step), esc(f"{r.proposer_parsed}/{r.proposer_calls}"),
                     num(r.candidates_proposed), esc(rejected) or "–", num(r.candidates_evaluated),
                     esc(r.decision), esc(r.accepted_candidate or best.candidate_id),
                     num(best.relative_error_reduction), short("; ".join(r.reasons or []))])
        classes.append("accepted" if r.decision == "accepted" else "")
    return table(["it", "step", "proposer parsed/calls", "proposed", "rejected before A/B", "evaluated", "decision",
                  "accepted (or best) candidate", "RER", "reasons"], rows, classes)


def _signed(value) -> str:
    return "–" if value is None else f"{value:+.3f}"


def _candidates(candidates: list[Candidate], charts) -> str:
    if not candidates:
        return "<p>No candidate was evaluated.</p>"
    counts = Counter(c.iteration for c in candidates)
    seen: dict[int, int] = {}
    points = []
    for c in candidates:
        k = seen[c.iteration] = seen.get(c.iteration, -1) + 1
        points.append({"iteration": c.iteration, "offset": (k - (counts[c.iteration] - 1) / 2) * 0.08,
                       "d_acc": c.d_acc or 0.0, "decision": given(c.decision, "–"), "applied": c.applied})
    rows = [[num(c.iteration), esc(c.candidate_id), esc(c.op), short(c.text, 90),
             esc(c.source), f"{num(c.base_acc)} → {num(c.cand_acc)}",
             _signed(c.d_acc), num(c.relative_error_reduction), num(c.changed_fraction),
             num(c.bootstrap_prob), _signed(c.d_fp_rate), num(c.eval_acc_drop),
             verdict(c.decision == "promoted", esc(c.decision), esc(c.decision))
             + (" (applied)" if c.applied else ""),
             short(c.reason, 80)] for c in candidates]
    return (charts.candidate_deltas(points)
            + table(["it", "candidate", "op", "rule", "source", "train acc A → B", "Δacc", "RER", "changed", "P(better)",
                     "Δfp", "eval drop", "gate", "reason"], rows, ["accepted" if c.applied else "" for c in candidates]))


def _section_of(doc: dict | None) -> GuidanceSection | None:
    """The (one) mission's section of a guidance file, None where there is none."""
    return filled(next(iter(doc.values()), None)) if doc else None


def _guidance(files: RunFiles, benchmarks: list[Benchmark]) -> str:
    snapshots = [_section_of(files.json(f"{artifacts.SNAPSHOTS_DIR}/{path.name}", Guidance, None))
                 for path in sorted((files.root / artifacts.SNAPSHOTS_DIR).glob(artifacts.SNAPSHOT_GLOB))]
    final = _section_of(files.json(artifacts.GUIDANCE.name, Guidance, "the final guidance"))
    states = {given(s.step, -1): s.experiences or {} for s in [*snapshots, final] if s is not None}
    parts = []
    for b in benchmarks:
        before, after = states.get(b.guidance_step_before), states.get(b.guidance_step_after)
        title = (f"Iteration {esc(b.iteration)}: {esc(b.op)} {esc(b.candidate_id)} "
                 f"(step {esc(b.guidance_step_before)} → {esc(b.guidance_step_after)}, "
                 f"RER {num(b.relative_error_reduction)}, train acc {num(b.base_acc)} → {num(b.after_acc)})")
        if before is not None and after is not None:
            lines = [f'<span class="del">- {esc(k)}: {esc(v)}</span>' for k, v in before.items() if after.get(k) != v]
            lines += [f'<span class="add">+ {esc(k)}: {esc(v)}</span>' for k, v in after.items() if before.get(k) != v]
            diff = "\n".join(lines) or "(no change in the rules)"
        else:
            key = b.accepted_key or b.target_signature or ""
            sign = "-" if b.op == "remove" else "+"
            diff = (f'<span class="{"del" if sign == "-" else "add"}">{sign} {esc(key)}: {esc(b.text)}</span>\n'
                    '<span class="muted">(the snapshots of these steps were pruned: the edit as '
                    f'{artifacts.BENCHMARKS.name} records it)</span>')
        parts.append(f"<h3>{title}</h3><pre>{diff}</pre>"
                     + (f'<p class="muted">rationale: {short(b.rationale)}</p>' if b.rationale else ""))
    if not benchmarks:
        parts.append("<p>No edit was accepted: the guidance is the seed guidance.</p>")
    if final is not None:
        rules = "\n".join(f"{esc(k)}: {esc(v)}" for k, v in (final.experiences or {}).items())
        parts.append(f"<h3>Final guidance (step {esc(final.step)})</h3><pre>{rules}</pre>")
    return "".join(parts)


def _proposer(files: RunFiles, iterations: list[Iteration] | None) -> str:
    answers = files.jsonl(artifacts.PROPOSER_ANSWERS.name, ProposerAnswer,
                          "each proposer answer and whether it parsed")
    failures = files.jsonl(artifacts.PROPOSER_FAILURES.name, ProposerFailure, None) or []
    parts = []
    if iterations is not None:
        calls = sum(r.proposer_calls or 0 for r in iterations)
        parsed = sum(r.proposer_parsed or 0 for r in iterations)
        parts.append(cards([("proposer calls", num(calls)), ("answers parsed", num(parsed)),
                            ("candidates proposed", num(sum(r.candidates_proposed or 0 for r in iterations)))]))
    if answers:
        rows = [[num(a.iteration), verdict(a.parsed, "parsed", "not parsed"), esc(a.finish_reason),
                 num(a.prompt_tokens), num(a.completion_tokens), num(a.examples_used),
                 "yes" if a.constrained else "no", short(a.error, 80),
                 f"<details><summary>{short(a.text, 70)}</summary><pre>{esc(a.text)}</pre></details>"
                 if a.text else "–"] for a in answers]
        parts.append(table(["it", "outcome", "finish", "prompt tok", "completion tok", "examples", "constrained",
                            "error", "answer"], rows))
    if failures:
        by_stage = Counter(given(f.stage, "?") for f in failures)
        file = os.path.basename(artifacts.PROPOSER_FAILURES.name)
        parts.append(f"<h3>Proposer failures and rejected proposals ({file})</h3>"
                     + table(["stage", "rows"], [[esc(k), num(v)] for k, v in sorted(by_stage.items())])
                     + table(["it", "stage", "error"], [[num(f.iteration), esc(f.stage), short(f.error)]
                                                        for f in failures[:40]]))
    return "".join(parts) or "<p>No proposer call is recorded.</p>"


def _hard_cases(rows: list[HardCase]) -> str:
    rows = sorted(rows, key=lambda r: given(r.rank, 0))[:HARD_CASES_SHOWN]
    return table(["rank", "ticket", "label", "majority", "agreement", "hard_wrong", "majority reason"], [
        [num(r.rank), esc(r.ticket_key), esc(r.gt_label), esc(r.majority_pred),
         num(r.agreement), num(r.hard_wrong), short(r.majority_reason, 100)] for r in rows])


def _audit_sections(files: RunFiles, summary: Summary, charts) -> list:
    m = (filled(files.json(artifacts.BASELINE_METRICS.name, AuditMetrics, "the audit's metrics"))
         or filled(summary.metrics) or AuditMetrics())
    overview = cards([("tickets used", num(given(m.n_used, summary.n_used))), ("accuracy", num(m.acc)),
                      ("fp_rate (false release)", num(m.fp_rate)), ("fn_rate (false block)", num(m.fn_rate)),
                      ("dropped (overlength)", num(given(m.n_dropped_overlength, summary.n_dropped_overlength)))])
    cm = ('<h3>Confusion matrix</h3><div class="scroll"><table class="cm"><tr><th></th><th>predicted pass</th>'
          f'<th>predicted fail or invalid</th></tr><tr><th>label pass</th><td>{num(m.tp)} (tp)</td>'
          f'<td>{num(m.fn)} (fn)</td></tr><tr><th>label fail</th><td>{num(m.fp)} (fp)</td>'
          f'<td>{num(m.tn)} (tn)</td></tr></table></div>')
    out = [("overview", "Audit metrics", overview + cm)]
    steps = files.jsonl(artifacts.BASELINE_STEPS.name, AuditStep, "the metrics as tickets were judged")
    if steps:
        out.append(("progress", "Metrics over the run order", charts.audit_progress(
            [{"n_done": s.n_done, "acc": s.acc, "fp_rate": s.fp_rate, "fn_rate": s.fn_rate} for s in steps])))
    hard = [r for r in files.jsonl(artifacts.HARD_CASES.name, HardCase, None) or []
            if r.sampler == "baseline"]
    if hard:
        out.append(("hard", "Hardest cases", _hard_cases(hard)))
    return out


def _headroom(h: Headroom, charts) -> str:
    labels = h.labels or LabelCounts()
    body = cards([("AUC", num(h.auc)), ("needed", num(h.min_auc)),
                  ("separates", verdict(h.separates)), ("tickets", num(h.tickets)),
                  ("pass share", num(h.pass_share)),
                  ("labels pass / fail", f"{esc(given(labels.pass_, '–'))} / {esc(given(labels.fail, '–'))}"),
                  ("mean P(pass)", num(h.mean_p_pass))])
    body += f"<p>{esc(h.message)}</p>"
    if h.per_ticket:
        body += charts.headroom_histogram([{"label": t.label, "p_pass": t.p_pass} for t in h.per_ticket])
    return body


def _seconds(value) -> int | float | None:
    """A duration of ``timing`` (which also holds counts and flags), None where it is not a number."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _pool(files: RunFiles, summary: Summary, charts) -> str:
    timeline = files.jsonl(artifacts.TIMELINE.name, TimelineRow,
                           "the per-worker timeline (busy and idle time, the proposer call)")
    workers = summary.workers or {}
    timing = summary.timing or {}
    wall_s, rollout_s = _seconds(timing.get("wall_s")), _seconds(timing.get("rollout_s"))
    parts = []
    if timeline:
        first_rank: dict[str, int] = {}
        for r in timeline:
            first_rank[r.device] = min(r.rank, first_rank.get(r.device, r.rank))
        names = list(workers) or sorted(first_rank, key=lambda d: first_rank[d])
        rows = [{"worker": r.device, "start_s": r.start_s, "end_s": r.end_s,
                 "kind": "proposer" if r.method == "chat" else (r.label or r.method or "other").split("/")[0]}
                for r in timeline]
        parts.append(charts.worker_timeline(rows, names, wall_s))
    done, saved = summary.generations_done, summary.generations_saved
    if done is not None:
        share = saved / (done + saved) if saved is not None and done + saved else None
        parts.append(cards([("generations done", num(done)), ("generations saved by the cache", num(saved)),
                            ("share served by the cache", num(share)), ("wall time (s)", num(wall_s, 1)),
                            ("rollout time (s)", num(rollout_s, 1))]))
    if workers:
        span = max((r.end_s for r in timeline), default=None) if timeline else wall_s
        parts.append(table(["worker", "tasks", "busy (s)", "busy share", "rollout tickets", "tickets/s"], [
            [esc(name), num(w.items), num(w.busy_s, 2),
             num(w.busy_s / span if span and w.busy_s is not None else None, 2),
             num(w.rollout_tickets), num(w.tickets_per_s, 2)] for name, w in workers.items()]))
    spec = timing.get("speculation")
    if isinstance(spec, dict) and spec.get("tasks"):
        parts.append(f"<p>Speculation: {num(spec.get('used'))} of {num(spec.get('tasks'))} speculative tasks used "
                     f"ahead, {num(spec.get('claimed_unstarted'))} claimed before they started "
                     f"(hit rate {num(spec.get('hit_rate'), 2)}); {num(spec.get('wasted_worker_s'), 1)} worker-seconds "
                     "went to discarded ones.</p>")
    other = {k: v for k, v in timing.items() if k not in ("wall_s", "rollout_s", "speculation")}
    if other:
        parts.append("<h3>Time per phase</h3>" + table(["phase", "value"], [[esc(k), num(v, 2)] for k, v in other.items()]))
    return "".join(parts) or "<p>Nothing is recorded about the pool.</p>"
