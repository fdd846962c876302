"""What ``stageb-pool check`` prints: what the run of a plan would do, as a short table."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..engine.registry import describe_note
from ..pool import Device, Ray
from ..stageb.errors import capped

if TYPE_CHECKING:
    from .config import Config
    from .plan import RunPlan


def describe(plan: RunPlan) -> str:
    """With ``--gpus``, the worker layout and memory budget too (nothing touches CUDA). Raises
    InputError where the run would (``prompt_budget``)."""
    from ..artifacts import DISTILL
    from ..search.rundir import run_dir_exists
    from ..stageb.ticket_pools import resolve_train_pool_size, split_eval_pool
    from .prompt_budget import measure_lines, rules_summary, sampler_caps

    cfg, inputs, run_dir, devices = plan.config, plan.inputs, plan.run_dir, plan.devices
    ray = isinstance(plan.backend, Ray)
    model = inputs.model
    tickets, ingest, g = inputs.tickets, inputs.ingest, inputs.seed_guidance
    rs, chunk = cfg.rule_search, cfg.runner.chunk_size
    lines = [
        ("config", f"{os.path.abspath(plan.config_path)} (hash {plan.identity().config_hash})"),
        ("mode", cfg.mode),
        ("mission", inputs.mission),
        ("tickets", f"{len(tickets)} ({_by_label(tickets)}); {len(ingest.skipped)} bad lines skipped; "
                    f"{ingest.excluded} excluded"),
    ]
    lines += [("  skipped", f"{s['location']}: {s['error']}") for s in ingest.skipped[:5]]
    lines += [(f"  {what}", ", ".join(f"{k} {n}" for k, n in counts.items()))
              for what, counts in (("converted", ingest.converted), ("ignored", ingest.ignored)) if counts]
    lines += [
        ("model", (model.path if model.path == cfg.model.path else f"{cfg.model.path} -> {model.path}")
         + describe_note(cfg.model.engine)),
        ("profile", _profile_line(cfg.prompt.profile, inputs.profile)),
        ("guidance", f"{cfg.guidance.path}: step {g.step}, {rules_summary(g.experiences)}: "
                     f"{', '.join(list(g.experiences)[:10])}{', ...' if len(g.experiences) > 10 else ''}"),
        ("run dir", f"{run_dir}" + (" (exists: needs --resume or --overwrite)" if run_dir_exists(run_dir) else "")),
    ]
    if devices is not None:
        lines += layout_lines(devices, ray=ray) + memory_lines(cfg, model, devices, ray=ray)
    dist = cfg.stage_b_distillation
    when = "after the audit" if cfg.mode == "audit" else "after the loop, with the final guidance"
    lines.append(("distill", f"{dist.distill_size} tickets {when} -> "
                  f"{dist.log_chatml_path or run_dir / DISTILL.name}" if dist.enabled else "off"))
    hr = cfg.headroom
    lines.append(("headroom", f"the judge's P(pass) on {min(hr.tickets, len(tickets))} tickets before the {cfg.mode} "
                              f"(teacher forcing, nothing generated); AUC >= {hr.min_auc} separates"
                  if hr.enabled else "off"))
    k_train = len(rs.train_sampler.grid) * rs.train_sampler.samples_per_decode
    k_eval = len(rs.eval_sampler.grid) * rs.eval_sampler.samples_per_decode
    if cfg.mode == "audit":
        lines += [
            ("samples", f"K={k_train} per ticket (train_sampler: {_k(rs.train_sampler)})"),
            ("rollout", f"{len(tickets)} tickets in {_chunks(len(tickets), chunk)} chunks of {chunk}: "
                        f"{len(tickets) * k_train} generations"),
        ]
        return _table(lines + measure_lines(cfg, inputs, sampler_caps(cfg, tickets)))
    train, held = split_eval_pool(tickets, rs.eval_pool_size, cfg.seed)
    t = resolve_train_pool_size(len(train), rs.train_pool_size, rs.train_pool_fraction)
    n = rs.num_candidate_rules
    per_iteration = t * k_train * (1 + n) + len(held) * k_eval
    lines += [
        ("eval pool", f"{len(held)} tickets ({_by_label(held)}), fixed for the run"),
        ("train", f"{len(train)} tickets; a train pool of {t} per iteration"),
        ("samples", f"train K={k_train} ({_k(rs.train_sampler)}), eval K={k_eval} ({_k(rs.eval_sampler)})"),
        ("chunks", f"chunk_size {chunk}: {_chunks(t, chunk)} per train rollout, {_chunks(len(held), chunk)} per eval rollout"),
        ("per iteration", f"up to {per_iteration} generations = train baseline {t * k_train} + {n} candidates x "
                          f"{t * k_train} + eval baseline {len(held) * k_eval}; 1 proposer call; "
                          f"+{len(held) * k_eval} per candidate that passes the gate"),
        ("iterations", f"at most {cfg.runner.epochs} (early stop after {rs.early_stop.patience} without an accepted edit)"),
    ]
    return _table(lines + measure_lines(cfg, inputs, sampler_caps(cfg, tickets)))


def layout_lines(devices: list[Device], *, ray: bool = False) -> list[tuple[str, str]]:
    """The workers and the GPUs each holds (run.json's layout); a line names a mask that renames the GPUs."""
    from ..pool.devices import mask_stop, mask_text, visible_mask

    size = devices[0].group_size
    kind = "CPU" if devices[0].kind == "cpu" else f"{size} GPU{'s' if size != 1 else ''}"
    lines = [("workers", f"{len(devices)} worker{'s' if len(devices) != 1 else ''} of {kind} each")]
    if ray:
        where = f"its {size} GPUs on one node" if size > 1 else "its GPU"
        lines.append(("  placement", f"Ray actors, one bundle per worker ({where}); Ray chooses the nodes and GPUs"))
    shown = devices if len(devices) <= 16 else devices[:8]
    lines += [(f"  w{d.rank}", _worker_gpus(d, ray=ray)) for d in shown]
    if len(shown) < len(devices):
        lines.append(("  ...", f"{len(devices) - len(shown)} more, up to w{devices[-1].rank} {devices[-1].name}"))
    mask = None if ray or devices[0].kind != "cuda" else visible_mask()
    if mask is not None and (mask != [str(i) for i in range(len(mask))] or mask_stop() is not None):
        lines.append(("  mask", f"{mask_text()}: --gpus numbers the GPUs it makes visible from 0"))
    return lines


def _worker_gpus(device, *, ray: bool = False) -> str:
    """``cuda:0,1 (GPUs 0, 1)``, or under a renaming mask ``GPUs 4, 5 (visible as 0, 1)``. Under
    Ray the numbers are ranks: Ray chooses the GPUs."""
    own = [str(g) for g in device.gpus]
    physical = own if ray else device.physical_gpus()
    if physical != own:
        s = "s" if len(own) > 1 else ""
        return f"GPU{s} {', '.join(physical)} (visible as {', '.join(own)})"
    return device.name + (f" (GPUs {', '.join(own)})" if device.group_size > 1 else "")


def memory_lines(cfg: Config, model, devices: list[Device], *, ray: bool = False) -> list[tuple[str, str]]:
    """``memory_budget`` for GPU workers; under Ray only the weights (the GPUs are the cluster's, not this host's)."""
    from ..engine.models import embedded_gguf_path
    from ..engine.registry import gpu_bytes
    from ..pool.devices import gpu_memory_bytes
    from .memory_budget import HeaderError, budget_lines, weight_bytes

    if devices[0].kind != "cuda":
        return []
    if model.kind == "tiny":
        return [("memory", "the tiny test model (a few MB): no estimate needed")]
    source = embedded_gguf_path() if model.kind == "embedded" else model.path
    try:
        weights = weight_bytes(source, cfg.model.dtype or "bfloat16")
    except (HeaderError, OSError) as err:
        return [("memory", f"no estimate: {err}")]
    return budget_lines(devices, weights, extra_bytes=gpu_bytes(cfg.model), gpu_memory=None if ray else gpu_memory_bytes())


def _k(sampler) -> str:
    n = len(sampler.grid)
    return f"{n} decode{'s' if n != 1 else ''} x {sampler.samples_per_decode} sample{'s' if sampler.samples_per_decode != 1 else ''}"


def _profile_line(configured: str, profile) -> str:
    facts = [f"{k} {getattr(profile, k)}" for k in ("language", "domain") if getattr(profile, k, None)]
    return f"{configured} ({', '.join(facts)})" if facts else configured


def _by_label(tickets) -> str:
    counts: dict[str, int] = {}
    for t in tickets:
        counts[t.label] = counts.get(t.label, 0) + 1
    return ", ".join(f"{label} {counts[label]}" for label in sorted(counts)) or "none"


def _chunks(n: int, size: int) -> int:
    return -(-n // size)


def _table(lines: list[tuple[str, str]]) -> str:
    """Each line capped (a value may quote a huge key, mission or path)."""
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {capped(v)}" for k, v in lines)
