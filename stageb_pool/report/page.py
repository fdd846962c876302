"""The report page: read a run directory's files, write one self-contained HTML page.

Everything comes from the files (docs/artifacts.md), nothing from the code that wrote them,
so a report can be rebuilt for any run, also one of an earlier version: a file it lacks is
named on the page with what it would have shown, and the rest is drawn from what is there.
The page makes no request of any kind (inline CSS and SVG, no script, and a Content
Security Policy that forbids loading anything), so it opens offline and leaks nothing.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

TIMELINE_FILE = "pool_timeline.jsonl"
REPORT_FILE = "report.html"
SHOWN_TEXT = 160  # characters of a rule or answer shown in a table cell (the rest on hover or unfolded)
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


class ReportError(ValueError):
    """The directory cannot be reported on (it does not exist, or is not a run)."""

    def __init__(self, message: str, location: str):
        super().__init__(f"{location}: {message}")
        self.message, self.location = message, location


class RunFiles:
    """A run directory's files, read leniently: a missing or unreadable file is read as None
    and noted in ``missing`` with what the report would have drawn from it."""

    def __init__(self, run_dir):
        self.root = Path(run_dir)
        if not self.root.is_dir():
            raise ReportError("not a run directory" if self.root.exists() else "no such directory", str(self.root))
        if not (self.root / "run.json").is_file():
            raise ReportError("not a stageb-pool run directory (it has no run.json)", str(self.root))
        self.missing: list[tuple[str, str]] = []

    def json(self, name: str, shows: str | None):
        try:
            return json.loads((self.root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            self._note(name, shows, err)
            return None

    def jsonl(self, name: str, shows: str | None) -> list[dict] | None:
        try:
            lines = (self.root / name).read_text(encoding="utf-8").splitlines()
            return [json.loads(line) for line in lines if line.strip()]
        except (OSError, ValueError) as err:
            self._note(name, shows, err)
            return None

    def _note(self, name: str, shows: str | None, err: Exception) -> None:
        # shows=None: a file a finished run may lack (no edit accepted, nothing wrong), so only
        # an unreadable one is named
        if not isinstance(err, FileNotFoundError):
            self.missing.append((name, f"unreadable ({type(err).__name__}): {shows or 'left out'}"))
        elif shows is not None:
            self.missing.append((name, f"missing: {shows}"))


# -- small HTML helpers --------------------------------------------------------------------
def esc(value) -> str:
    return html.escape("" if value is None else str(value))


def num(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else esc(value)


def short(text, limit: int = SHOWN_TEXT) -> str:
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return esc(text)
    return f'<span title="{esc(text)}">{esc(text[:limit])}…</span>'


def table(headers: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """Cells are HTML already; a cell starting with a digit, a sign or a dash is right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(f'<td class="n">{c}</td>' if c[:1].isdigit() or c[:1] in "-–+" else f"<td>{c}</td>"
                        for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def cards(items: list[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(f'<div class="card"><b>{v}</b><span>{esc(k)}</span></div>'
                                           for k, v in items) + "</div>"


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def verdict(ok: bool | None, yes: str = "yes", no: str = "no") -> str:
    return '<span class="muted">–</span>' if ok is None else (f'<span class="ok">{yes}</span>' if ok
                                                             else f'<span class="bad">{no}</span>')


# -- the page ------------------------------------------------------------------------------
def render_report(run_dir) -> str:
    """The report of ``run_dir`` as one HTML document. Raises ReportError when the directory
    is not a run; anything a run of another version lacks is named on the page instead."""
    from . import charts  # matplotlib, only now (see charts.py)

    files = RunFiles(run_dir)
    run = files.json("run.json", None) or {}
    summary = files.json("summary.json", "the final metrics, the cache counts and the per-worker throughput") or {}
    mode = summary.get("mode") or (run.get("config") or {}).get("mode") or "search"
    mission = summary.get("mission") or next(iter(files.json("guidance.json", None) or {}), "")
    sections = _search_sections(files, summary, charts) if mode == "search" else _audit_sections(files, summary, charts)
    headroom = files.json("judge_headroom.json", "the judge-headroom result" if mode == "search" else None)
    if headroom is not None:
        sections.append(("headroom", "Judge headroom", _headroom(headroom, charts)))
    sections.append(("pool", "The pool's work", _pool(files, summary, charts)))
    invocation = run.get("invocation") or {}
    tool = run.get("tool") or {}
    sub = " · ".join(esc(x) for x in (f"{mode} run", f"started {invocation.get('started_at', '?')}",
                                       f"{invocation.get('workers', '?')} worker(s) ({invocation.get('gpus', '?')})",
                                       f"{tool.get('name', 'stageb_pool')} {tool.get('version', '')}", files.root))
    nav = "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t, _ in sections)
    missing = ""
    if files.missing:
        items = "".join(f"<li><code>{esc(n)}</code> {esc(why)}</li>" for n, why in files.missing)
        missing = (f'<div class="missing"><b>Missing or unreadable files</b> (a run of an earlier version, '
                   f'or one that did not finish); the page shows what the other files hold:<ul>{items}</ul></div>')
    body = "".join(section(a, t, b) for a, t, b in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>stageb-pool report: {esc(mission)}</title><style>{CSS}</style></head>"
            f"<body><main><h1>{esc(mission) or 'stageb-pool run'}</h1><p class=\"sub\">{sub}</p>"
            f"<nav>{nav}</nav>{missing}{body}</main></body></html>\n")


def _metric_line(m) -> str:
    return "–" if not m else f"{num(m.get('acc'))} (fp {num(m.get('fp_rate'))}, n={m.get('n')})"


def _search_sections(files: RunFiles, summary: dict, charts) -> list:
    iterations = files.jsonl("rule_search_iterations.jsonl", "per-iteration metrics, gate decisions and "
                             "proposer outcomes (drawn from rule_candidates.jsonl instead, where it can)")
    candidates = files.jsonl("rule_candidates.jsonl", None) or []  # absent: no candidate was evaluated
    benchmarks = files.jsonl("benchmarks.jsonl", None) or []  # absent: no edit was accepted
    base, final = summary.get("baseline") or {}, summary.get("final") or {}
    overview = cards([("iterations", num(summary.get("iterations"))), ("stop reason", esc(summary.get("stop_reason"))),
                      ("edits accepted", num(summary.get("edits_accepted", len(benchmarks)))),
                      ("train accuracy: baseline → final",
                       f"{num((base.get('train') or {}).get('acc'))} → {num((final.get('train') or {}).get('acc'))}"),
                      ("eval accuracy: baseline → final",
                       f"{num((base.get('eval') or {}).get('acc'))} → {num((final.get('eval') or {}).get('acc'))}"),
                      ("eval fp_rate: baseline → final",
                       f"{num((base.get('eval') or {}).get('fp_rate'))} → {num((final.get('eval') or {}).get('fp_rate'))}")])
    out = [("overview", "Overview", overview + table(["", "baseline", "final"], [
        [split, _metric_line(base.get(split)), _metric_line(final.get(split))] for split in ("train", "eval")]))]
    points, accepted = _iteration_points(iterations, candidates, benchmarks, final)
    body = charts.metrics_per_iteration(points, accepted) if points else "<p>No iteration finished.</p>"
    if iterations is None:
        body += '<p class="muted">From rule_candidates.jsonl: iterations without candidates are not shown; ' \
                'train fp_rate on the tickets baseline and candidate share.</p>'
    else:
        body += _iteration_table(iterations)
    out.append(("iterations", "Metrics per iteration", body))
    out.append(("candidates", "Candidates and the gate", _candidates(candidates, charts)))
    out.append(("guidance", "Guidance as it evolved", _guidance(files, benchmarks)))
    out.append(("proposer", "Proposer", _proposer(files, iterations)))
    hard = [r for r in files.jsonl("rule_search_hard_cases.jsonl", None) or []  # absent: no confident error
            if r.get("sampler") == "train"]
    if hard:
        last = max(r["iteration"] for r in hard)
        out.append(("hard", f"Hardest cases (iteration {last})",
                    _hard_cases([r for r in hard if r["iteration"] == last])))
    return out


def _iteration_points(iterations, candidates, benchmarks, final):
    if iterations is not None:
        points = [{"x": r["iteration"], "tick": str(r["iteration"]), **(r.get("baseline") or {})} for r in iterations]
        accepted = [r["iteration"] for r in iterations if r.get("decision") == "accepted"]
    else:
        first: dict[int, dict] = {}
        for c in candidates:
            first.setdefault(c["iteration"], c)
        points = [{"x": it, "tick": str(it), "train": {"acc": c.get("base_acc"), "fp_rate": c.get("base_fp_rate")},
                   "eval": {"acc": c.get("eval_base_acc")}} for it, c in sorted(first.items())]
        accepted = sorted({b["iteration"] for b in benchmarks})
    if points and (final.get("train") or final.get("eval")):
        points.append({"x": points[-1]["x"] + 1, "tick": "final", "train": final.get("train"), "eval": final.get("eval")})
    return points, accepted


def _iteration_table(iterations: list[dict]) -> str:
    rows, classes = [], []
    for r in iterations:
        rejected = ", ".join(f"{k} {v}" for k, v in (r.get("candidates_rejected") or {}).items())
        best = r.get("best_candidate") or {}
        rows.append([num(r["iteration"]), num(r.get("guidance_step")), f"{r.get('proposer_parsed')}/{r.get('proposer_calls')}",
                     num(r.get("candidates_proposed")), esc(rejected) or "–", num(r.get("candidates_evaluated")),
                     esc(r.get("decision")), esc(r.get("accepted_candidate") or best.get("candidate_id")),
                     num(best.get("relative_error_reduction")), short("; ".join(r.get("reasons") or []))])
        classes.append("accepted" if r.get("decision") == "accepted" else "")
    return table(["it", "step", "proposer parsed/calls", "proposed", "rejected before A/B", "evaluated", "decision",
                  "accepted (or best) candidate", "RER", "reasons"], rows, classes)


def _candidates(candidates: list[dict], charts) -> str:
    if not candidates:
        return "<p>No candidate was evaluated.</p>"
    counts: dict[int, int] = {}
    for c in candidates:
        counts[c["iteration"]] = counts.get(c["iteration"], 0) + 1
    seen: dict[int, int] = {}
    points = []
    for c in candidates:
        k = seen[c["iteration"]] = seen.get(c["iteration"], -1) + 1
        points.append({"iteration": c["iteration"], "offset": (k - (counts[c["iteration"]] - 1) / 2) * 0.08,
                       "d_acc": c.get("d_acc") or 0.0, "decision": c.get("decision"), "applied": c.get("applied")})
    rows = [[num(c["iteration"]), esc(c.get("candidate_id")), esc(c.get("op")), short(c.get("text"), 90),
             esc(c.get("source")), f"{num(c.get('base_acc'))} → {num(c.get('cand_acc'))}",
             f"{c.get('d_acc', 0):+.3f}", num(c.get("relative_error_reduction")), num(c.get("changed_fraction")),
             num(c.get("bootstrap_prob")), f"{c.get('d_fp_rate', 0):+.3f}", num(c.get("eval_acc_drop")),
             verdict(c.get("decision") == "promoted", esc(c.get("decision")), esc(c.get("decision")))
             + (" (applied)" if c.get("applied") else ""),
             short(c.get("reason"), 80)] for c in candidates]
    return (charts.candidate_deltas(points)
            + table(["it", "candidate", "op", "rule", "source", "train acc A → B", "Δacc", "RER", "changed", "P(better)",
                     "Δfp", "eval drop", "gate", "reason"], rows, ["accepted" if c.get("applied") else "" for c in candidates]))


def _guidance(files: RunFiles, benchmarks: list[dict]) -> str:
    states: dict[int, dict] = {}
    for path in sorted((files.root / "snapshots").glob("guidance-step*.json")):
        doc = files.json(f"snapshots/{path.name}", None)
        if doc:
            section_ = next(iter(doc.values()))
            states[section_.get("step", -1)] = section_.get("experiences") or {}
    current = files.json("guidance.json", "the final guidance") or {}
    final = next(iter(current.values()), {}) if current else {}
    if final:
        states[final.get("step", -1)] = final.get("experiences") or {}
    parts = []
    for b in benchmarks:
        before, after = states.get(b.get("guidance_step_before")), states.get(b.get("guidance_step_after"))
        title = (f"Iteration {b['iteration']}: {esc(b.get('op'))} {esc(b.get('candidate_id'))} "
                 f"(step {b.get('guidance_step_before')} → {b.get('guidance_step_after')}, "
                 f"RER {num(b.get('relative_error_reduction'))}, train acc {num(b.get('base_acc'))} → {num(b.get('after_acc'))})")
        if before is not None and after is not None:
            lines = [f'<span class="del">- {esc(k)}: {esc(v)}</span>' for k, v in before.items() if after.get(k) != v]
            lines += [f'<span class="add">+ {esc(k)}: {esc(v)}</span>' for k, v in after.items() if before.get(k) != v]
            diff = "\n".join(lines) or "(no change in the rules)"
        else:
            key = b.get("accepted_key") or b.get("target_signature") or ""
            sign = "-" if b.get("op") == "remove" else "+"
            diff = (f'<span class="{"del" if sign == "-" else "add"}">{sign} {esc(key)}: {esc(b.get("text"))}</span>\n'
                    f'<span class="muted">(the snapshots of these steps were pruned: the edit as benchmarks.jsonl '
                    f'records it)</span>')
        parts.append(f"<h3>{title}</h3><pre>{diff}</pre>"
                     + (f'<p class="muted">rationale: {short(b.get("rationale"))}</p>' if b.get("rationale") else ""))
    if not benchmarks:
        parts.append("<p>No edit was accepted: the guidance is the seed guidance.</p>")
    if final:
        rules = "\n".join(f"{esc(k)}: {esc(v)}" for k, v in (final.get("experiences") or {}).items())
        parts.append(f"<h3>Final guidance (step {esc(final.get('step'))})</h3><pre>{rules}</pre>")
    return "".join(parts)


def _proposer(files: RunFiles, iterations) -> str:
    answers = files.jsonl("reflection_cache/proposer_answers.jsonl", "each proposer answer and whether it parsed")
    failures = files.jsonl("reflection_cache/rule_search_proposer_failures.jsonl", None) or []
    parts = []
    if iterations is not None:
        calls = sum(r.get("proposer_calls") or 0 for r in iterations)
        parsed = sum(r.get("proposer_parsed") or 0 for r in iterations)
        parts.append(cards([("proposer calls", num(calls)), ("answers parsed", num(parsed)),
                            ("candidates proposed", num(sum(r.get("candidates_proposed") or 0 for r in iterations)))]))
    if answers:
        rows = [[num(a.get("iteration")), verdict(a.get("parsed"), "parsed", "not parsed"), esc(a.get("finish_reason")),
                 num(a.get("prompt_tokens")), num(a.get("completion_tokens")), num(a.get("examples_used")),
                 "yes" if a.get("constrained") else "no", short(a.get("error"), 80),
                 f"<details><summary>{short(a.get('text'), 70)}</summary><pre>{esc(a.get('text'))}</pre></details>"
                 if a.get("text") else "–"] for a in answers]
        parts.append(table(["it", "outcome", "finish", "prompt tok", "completion tok", "examples", "constrained",
                            "error", "answer"], rows))
    if failures:
        by_stage: dict[str, int] = {}
        for f in failures:
            by_stage[f.get("stage", "?")] = by_stage.get(f.get("stage", "?"), 0) + 1
        parts.append("<h3>Proposer failures and rejected proposals (rule_search_proposer_failures.jsonl)</h3>"
                     + table(["stage", "rows"], [[esc(k), num(v)] for k, v in sorted(by_stage.items())])
                     + table(["it", "stage", "error"], [[num(f.get("iteration")), esc(f.get("stage")), short(f.get("error"))]
                                                        for f in failures[:40]]))
    return "".join(parts) or "<p>No proposer call is recorded.</p>"


def _hard_cases(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: r.get("rank", 0))[:HARD_CASES_SHOWN]
    return table(["rank", "ticket", "label", "majority", "agreement", "hard_wrong", "majority reason"], [
        [num(r.get("rank")), esc(r.get("ticket_key")), esc(r.get("gt_label")), esc(r.get("majority_pred")),
         num(r.get("agreement")), num(r.get("hard_wrong")), short(r.get("majority_reason"), 100)] for r in rows])


def _audit_sections(files: RunFiles, summary: dict, charts) -> list:
    m = files.json("baseline_metrics.json", "the audit's metrics") or summary.get("metrics") or {}
    overview = cards([("tickets used", num(m.get("n_used", summary.get("n_used")))), ("accuracy", num(m.get("acc"))),
                      ("fp_rate (false release)", num(m.get("fp_rate"))), ("fn_rate (false block)", num(m.get("fn_rate"))),
                      ("dropped (overlength)", num(m.get("n_dropped_overlength", summary.get("n_dropped_overlength"))))])
    cm = ('<h3>Confusion matrix</h3><div class="scroll"><table class="cm"><tr><th></th><th>predicted pass</th>'
          f'<th>predicted fail or invalid</th></tr><tr><th>label pass</th><td>{num(m.get("tp"))} (tp)</td>'
          f'<td>{num(m.get("fn"))} (fn)</td></tr><tr><th>label fail</th><td>{num(m.get("fp"))} (fp)</td>'
          f'<td>{num(m.get("tn"))} (tn)</td></tr></table></div>')
    out = [("overview", "Audit metrics", overview + cm)]
    steps = files.jsonl("baseline_metrics_steps.jsonl", "the metrics as tickets were judged")
    if steps:
        out.append(("progress", "Metrics over the run order", charts.audit_progress(steps)))
    hard = [r for r in files.jsonl("rule_search_hard_cases.jsonl", None) or []
            if r.get("sampler") == "baseline"]
    if hard:
        out.append(("hard", "Hardest cases", _hard_cases(hard)))
    return out


def _headroom(h: dict, charts) -> str:
    labels = h.get("labels") or {}
    body = cards([("AUC", num(h.get("auc"))), ("needed", num(h.get("min_auc"))),
                  ("separates", verdict(h.get("separates"))), ("tickets", num(h.get("tickets"))),
                  ("pass share", num(h.get("pass_share"))), ("labels pass / fail", f"{labels.get('pass', '–')} / {labels.get('fail', '–')}"),
                  ("mean P(pass)", num(h.get("mean_p_pass")))])
    body += f"<p>{esc(h.get('message'))}</p>"
    if h.get("per_ticket"):
        body += charts.headroom_histogram(h["per_ticket"])
    return body


def _pool(files: RunFiles, summary: dict, charts) -> str:
    timeline = files.jsonl(TIMELINE_FILE, "the per-worker timeline (busy and idle time, the proposer call)")
    workers = summary.get("workers") or {}
    timing = summary.get("timing") or {}
    parts = []
    if timeline:
        names = list(workers) or sorted({r["device"] for r in timeline}, key=lambda d: min(
            r["rank"] for r in timeline if r["device"] == d))
        rows = [{"worker": r["device"], "start_s": r["start_s"], "end_s": r["end_s"],
                 "kind": "proposer" if r.get("method") == "chat" else (r.get("label") or r.get("method") or "other").split("/")[0]}
                for r in timeline]
        parts.append(charts.worker_timeline(rows, names, timing.get("wall_s")))
    done, saved = summary.get("generations_done"), summary.get("generations_saved")
    if done is not None:
        share = saved / (done + saved) if saved is not None and done + saved else None
        parts.append(cards([("generations done", num(done)), ("generations saved by the cache", num(saved)),
                            ("share served by the cache", num(share)), ("wall time (s)", num(timing.get("wall_s"), 1)),
                            ("rollout time (s)", num(timing.get("rollout_s"), 1))]))
    if workers:
        span = max((r["end_s"] for r in timeline), default=None) if timeline else timing.get("wall_s")
        parts.append(table(["worker", "tasks", "busy (s)", "busy share", "rollout tickets", "tickets/s"], [
            [esc(name), num(w.get("items")), num(w.get("busy_s"), 2),
             num(w["busy_s"] / span if span and w.get("busy_s") is not None else None, 2),
             num(w.get("rollout_tickets")), num(w.get("tickets_per_s"), 2)] for name, w in workers.items()]))
    spec = timing.get("speculation") or {}
    if spec.get("tasks"):
        parts.append(f"<p>Speculation: {num(spec.get('used'))} of {num(spec.get('tasks'))} speculative tasks used "
                     f"ahead, {num(spec.get('claimed_unstarted'))} claimed before they started "
                     f"(hit rate {num(spec.get('hit_rate'), 2)}); {num(spec.get('wasted_worker_s'), 1)} worker-seconds "
                     "went to discarded ones.</p>")
    other = {k: v for k, v in timing.items() if k not in ("wall_s", "rollout_s", "speculation")}
    if other:
        parts.append("<h3>Time per phase</h3>" + table(["phase", "value"], [[esc(k), num(v, 2)] for k, v in other.items()]))
    return "".join(parts) or "<p>Nothing is recorded about the pool.</p>"
