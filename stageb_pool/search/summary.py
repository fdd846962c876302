"""The rule search's summary: the final metrics, ``summary.json``'s content and the lines
printed on stdout."""

from __future__ import annotations

import sys

import msgspec

from ..stageb.verdicts import compute_metrics
from .headroom import summary_line
from .iteration import eval_spec, train_spec
from .settings import SearchSettings


def brief(metrics) -> dict | None:
    return None if metrics is None else {"n": metrics.n, "acc": metrics.acc, "fp_rate": metrics.fp_rate,
                                         "fn_rate": metrics.fn_rate}


def final_metrics(recorder, settings: SearchSettings, guidance, *, first_pool: list, eval_pool: list,
                  iterations: int) -> dict:
    """The final guidance on the first train pool (same seed key: the comparison with the
    baseline is paired) and on the eval pool; both usually come from the runner's cache."""
    out = {"train": None, "eval": None}
    runner, pendings = recorder.runner, []
    if first_pool:
        pendings.append(("train", runner.submit(train_spec("final/train", settings, first_pool, guidance))))
    if eval_pool and iterations:
        pendings.append(("eval", runner.submit(eval_spec("final/eval", settings, eval_pool, guidance))))
    if pendings:
        results = recorder.wait([p for _, p in pendings])
        for (name, _), result in zip(pendings, results):
            out[name] = brief(compute_metrics(result.stats))
    return out


def search_summary(state, settings: SearchSettings, guidance, *, final: dict, distillation: dict | None, n_train: int,
                   n_eval: int, runner, timing: dict, headroom: dict | None = None) -> dict:
    """``summary.json`` of the rule search (``job.write_summary`` adds timing and workers)."""
    return {
        "mode": "search",
        "mission": settings.mission,
        "iterations": state.iteration,
        "stop_reason": state.stop_reason,
        "edits_accepted": len(state.edits),
        "edits": msgspec.to_builtins(state.edits),
        "guidance_step": guidance.step,
        "guidance_hash": guidance.hash,
        "train_pool": {"n_train": n_train, "size": state.sampler.size},
        "eval_pool": {"n": n_eval},
        "baseline": msgspec.to_builtins(state.baseline) if state.baseline else {"train": None, "eval": None},
        "final": final,
        "rejected_candidates": len(state.rejected_ids),
        "distillation": distillation,
        "judge_headroom": headroom,
        # The run's counts (continued from state.json on resume); this process's are in timing.
        "generations_done": runner.run_done,
        "generations_saved": runner.run_saved,
        "timing": timing,  # volatile (wall clock)
    }


def print_summary(summary: dict) -> None:
    base, final = summary["baseline"], summary["final"]

    def fmt(m):
        return f"acc {m['acc']:.3f} fp {m['fp_rate']:.3f} (n={m['n']})" if m else "-"

    lines = [
        f"rule search: {summary['iterations']} iterations, stop: {summary['stop_reason']}, "
        f"{len(summary['edits'])} edits accepted, guidance step {summary['guidance_step']}",
        *(f"  it{e['iteration']}: {e['candidate_id']} (RER {e['relative_error_reduction']:.3f})" for e in summary["edits"]),
        f"  train: baseline {fmt(base.get('train'))} -> final {fmt(final.get('train'))}",
        f"  eval:  baseline {fmt(base.get('eval'))} -> final {fmt(final.get('eval'))}",
        f"  generations: {summary['generations_done']} done, {summary['generations_saved']} saved by the cache",
    ]
    headroom = summary_line(summary)
    if headroom is not None:
        lines.append(headroom)
    if summary.get("why"):
        lines.append(f"  why: {summary['why']}")
    print("\n".join(lines), file=sys.stdout, flush=True)
