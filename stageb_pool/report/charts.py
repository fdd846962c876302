"""The report's charts: matplotlib figures rendered as inline SVG text.

Imported only while a report is built (``page.load_chart_libraries``): matplotlib is a heavy
import (with threads), and the run's parent must stay lean until its workers are forked. No
pyplot: a bare ``Figure`` needs no GUI backend and keeps no global figure list. The SVG is
self-contained (text as text, no fonts, no links) and reproducible: ``svg.hashsalt`` fixes the
element ids (one salt per chart, so no two charts share an id) and the date metadata is left
out, so the same files give the same bytes.
"""

from __future__ import annotations

import io
import re

import matplotlib
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .markup import visible

COLORS = {"headroom": "#ff7f0e", "train": "#1f77b4", "eval": "#2ca02c", "proposer": "#d62728", "final": "#9467bd",
          "audit": "#1f77b4", "distill": "#8c564b", "other": "#7f7f7f"}
DECISION_COLORS = {"promoted": "#2ca02c", "rejected": "#d62728", "rejected_eval_veto": "#ff7f0e"}  # the gate's words
_SIZE = re.compile(r'<svg([^>]*?) width="([\d.]+)pt" height="([\d.]+)pt"')
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.DOTALL)  # RDF about matplotlib: bytes, no use
LABEL_CHARS = 80  # of a name from the files shown in a chart (a worker, a gate decision, a task kind)


def _label(text: str) -> str:
    """A name from the run's files as chart text: shown as it reads (markup.visible), cut to
    LABEL_CHARS, and with ``$`` escaped, so that matplotlib never parses it as mathtext (a
    stray ``$`` or ``\\frac`` there would fail the whole report)."""
    text = visible(text)
    if len(text) > LABEL_CHARS:
        text = text[:LABEL_CHARS] + "…"
    return text.replace("$", r"\$")


def _svg(fig: Figure, name: str, label: str) -> str:
    """The figure as an ``<svg>`` element for an HTML page (no XML prolog), scaled down to
    the page's width but never up, with ``label`` for screen readers."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"stageb-report-{name}", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    text = _METADATA.sub("", text[text.index("<svg"):], count=1)
    return _SIZE.sub(lambda m: f'<svg{m.group(1)} class="chart" role="img" aria-label="{label}" '
                               f'style="width:100%;max-width:{m.group(2)}pt;height:auto"', text, count=1)


def _figure(width: float, height: float, columns: int = 1):
    fig = Figure(figsize=(width, height), dpi=100)
    fig.set_layout_engine("constrained")
    return fig, fig.subplots(1, columns)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # none: a file without the values (the page names it)
        ax.legend(fontsize=9)


def metrics_per_iteration(points: list[dict], accepted: list[int]) -> str:
    """Accuracy and false-release rate (fp_rate) per iteration, train and eval, with the
    iterations whose edit was accepted marked. ``points``: {"x", "tick", "train", "eval"},
    each split a metrics dict or None."""
    fig, axes = _figure(10, 3.4, columns=2)
    xs = [p["x"] for p in points]
    for ax, key, title in ((axes[0], "acc", "accuracy"), (axes[1], "fp_rate", "false-release rate (fp_rate)")):
        top = 0.0
        for split in ("train", "eval"):
            pts = [(p["x"], p[split][key]) for p in points if p.get(split) and p[split].get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS[split], label=split)
                top = max([top] + [y for _, y in pts])
        # from zero, so that a small change looks small; accuracy on its whole range
        ax.set_ylim(0, 1.02 if key == "acc" else max(0.05, top * 1.15))
        for it in accepted:
            ax.axvline(it + 0.5, color="#2ca02c", linestyle="--", linewidth=1, alpha=0.7)
        ax.set_title(title, fontsize=11)
        ax.set_xticks(xs, [p["tick"] for p in points])
        ax.set_xlabel("iteration (guidance at its start)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if accepted:
        handles.append(Line2D([], [], color="#2ca02c", linestyle="--"))
        labels.append("edit accepted")
    if handles:
        axes[0].legend(handles, labels, fontsize=9)
    return _svg(fig, "metrics", "accuracy and fp_rate per iteration")


def candidate_deltas(cands: list[dict]) -> str:
    """Each evaluated candidate's A/B delta (train accuracy, candidate minus baseline) by
    iteration, coloured by the gate's verdict; the applied one ringed."""
    fig, ax = _figure(10, 3.2)
    ax.axhline(0, color="#444", linewidth=0.8)
    for decision in sorted({c["decision"] for c in cands}, key=lambda d: (d not in DECISION_COLORS, d)):
        color = DECISION_COLORS.get(decision, COLORS["other"])
        pts = [(c["iteration"] + c["offset"], c["d_acc"]) for c in cands if c["decision"] == decision]
        if pts:
            ax.scatter(*zip(*pts), color=color, label=_label(decision), s=36, zorder=3)
    applied = [(c["iteration"] + c["offset"], c["d_acc"]) for c in cands if c["applied"]]
    if applied:
        ax.scatter(*zip(*applied), facecolors="none", edgecolors="black", s=140, linewidths=1.5,
                   label="applied", zorder=4)
    iterations = sorted({c["iteration"] for c in cands})
    ax.set_xticks(iterations, [str(i) for i in iterations])
    # Half an iteration either side: a lone iteration's candidates sit around its tick, not
    # stretched to the plot's edges by matplotlib's margins around their small offsets.
    ax.set_xlim(iterations[0] - 0.5, iterations[-1] + 0.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("Δ train accuracy")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _svg(fig, "candidates", "A/B delta of every candidate")


def headroom_histogram(per_ticket: list[dict]) -> str:
    """The judge's P(pass) per ticket, one histogram per ground-truth label."""
    fig, ax = _figure(7, 3)
    bins = [i / 20 for i in range(21)]
    for label, color in (("pass", COLORS["eval"]), ("fail", COLORS["proposer"])):
        values = [t["p_pass"] for t in per_ticket if t.get("label") == label and t.get("p_pass") is not None]
        if values:
            ax.hist(values, bins=bins, alpha=0.55, color=color, label=f"label {label} ({len(values)})")
    ax.set_xlabel("judge's P(pass)")
    ax.set_ylabel("tickets")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    _legend(ax)
    return _svg(fig, "headroom", "P(pass) histogram by label")


def worker_timeline(rows: list[dict], workers: list[str], wall_s: float | None) -> str:
    """Busy intervals per worker over the run (gaps are idle time), coloured by what the task
    was: train / eval / final rollouts, the proposer call. Neighbouring intervals of the same
    kind closer than 1/2000 of the run are drawn as one bar, so a run of many thousand chunks
    stays a small SVG."""
    end = max([r["end_s"] for r in rows] + [wall_s or 0.0]) or 1.0
    merge_gap = end / 2000
    fig, ax = _figure(10, 0.9 + 0.45 * len(workers))
    ax.set_autoscale_on(False)  # the limits are set below: autoscaling after every bar took 0.05 s at 64 workers
    by_worker: dict[str, list[dict]] = {}
    for r in rows:
        by_worker.setdefault(r["worker"], []).append(r)
    boxes: dict[str, list] = {}  # kind (in order of first appearance) -> the corners of each of its bars
    for y, worker in enumerate(workers):
        bars: dict[str, list[list[float]]] = {}
        for r in sorted(by_worker.get(worker, ()), key=lambda r: r["start_s"]):
            kind = r["kind"]
            spans = bars.setdefault(kind, [])
            if spans and r["start_s"] - spans[-1][1] <= merge_gap:
                spans[-1][1] = max(spans[-1][1], r["end_s"])
            else:
                spans.append([r["start_s"], r["end_s"]])
        for kind, spans in bars.items():
            for start, stop in spans:
                right = start + max(stop - start, end / 5000)  # at least a visible sliver
                boxes.setdefault(kind, []).append([(start, y - 0.35), (start, y + 0.35), (right, y + 0.35),
                                                   (right, y - 0.35)])
    # One collection per kind, the proposer's drawn on top: one per worker and kind (182 at 64
    # workers, each laid out and drawn twice) made this chart 0.37 s against 0.26.
    for kind in sorted(boxes, key=lambda k: k == "proposer"):
        ax.add_collection(PolyCollection(boxes[kind], facecolors=COLORS.get(kind, COLORS["other"]), linewidths=0))
    ax.set_yticks(range(len(workers)), [_label(w) for w in workers])
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds since the pool was made (its workers start first; later gaps: idle)")
    ax.grid(axis="x", alpha=0.3)
    known = ("headroom", "train", "eval", "final", "audit", "distill", "proposer")
    order = [k for k in known if k in boxes] + [k for k in boxes if k not in known]  # unknown: grey
    ax.legend([Patch(color=COLORS.get(k, COLORS["other"])) for k in order], [_label(k) for k in order], fontsize=9,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig, "timeline", "busy and idle time per worker")


def audit_progress(steps: list[dict]) -> str:
    """The audit's accuracy and fp_rate over the first n tickets of the run order."""
    fig, ax = _figure(8, 3)
    xs = [s["n_done"] for s in steps]
    for key, color in (("acc", COLORS["train"]), ("fp_rate", COLORS["proposer"]), ("fn_rate", COLORS["final"])):
        ys = [s.get(key) for s in steps]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", color=color, label=key)
    ax.set_xlabel("tickets of the run order judged")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend(ax)
    return _svg(fig, "audit", "audit metrics as tickets were judged")


def warm_up() -> None:
    """Draw a throwaway chart: matplotlib's first savefig imports its SVG and Agg backends and
    reads the font, which a process that imported charts.py ahead (the run's report process)
    does then rather than when its page is asked for."""
    audit_progress([{"n_done": 1, "acc": 0.5, "fp_rate": 0.5, "fn_rate": 0.5}])
