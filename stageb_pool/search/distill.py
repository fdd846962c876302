"""The distillation export (upstream 3.9): tickets judged once under a guidance, written as
ChatML conversations for fine-tuning. When it runs, which tickets and which sample, and how
it deviates from upstream: docs/rule_search.md, "Distillation export".
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from ..artifact_rows import DistillRow
from ..artifacts import DISTILL
from ..engine.records import SamplerConfig
from ..stageb.prompts import build_messages
from .rollout import rollout_spec
from .settings import DistillConfig


def distill_sampler(train_sampler: SamplerConfig, temperature: float | None) -> SamplerConfig:
    """The train-grid entry at ``temperature`` (None: the lowest train temperature), else the
    closest entry with its temperature replaced; one sample."""
    grid = list(train_sampler.grid)
    if temperature is None:
        temperature = min(d.temperature for d in grid)
    exact = [d for d in grid if d.temperature == temperature]
    if exact:
        decode = exact[0]
    else:
        closest = min(grid, key=lambda d: abs(d.temperature - temperature))
        decode = msgspec.structs.replace(closest, temperature=float(temperature))
    return msgspec.structs.replace(train_sampler, grid=[decode], samples_per_decode=1)


def distill_tickets(tickets: list, size: int, seed: int) -> list:
    rng = random.Random(seed)
    if size >= len(tickets):
        tickets = list(tickets)
        rng.shuffle(tickets)
        return tickets
    return rng.sample(tickets, size)


def distill_rows(tickets: list, result, profile, guidance) -> list[DistillRow]:
    """A conversation per ticket with a valid sample: the exact rollout system and user
    messages plus ``Verdict: <word>\\nReason: <reason>``."""
    rows = []
    for t in tickets:
        s = result.stats.get(t.key)
        if s is None or not s.verdicts or s.verdicts[0] is None:
            continue
        word = profile.verdict.pass_text if s.verdicts[0] == "pass" else profile.verdict.fail_text
        messages = [*build_messages(profile, guidance.experiences, t.text()),
                    {"role": "assistant", "content": f"Verdict: {word}\nReason: {s.reasons[0]}"}]
        rows.append(DistillRow(ticket_key=t.key, group_id=t.group_id, mission=t.mission, label=t.label,
                               messages=messages))
    return rows


def export_distillation(recorder, *, tickets: list, guidance, settings: DistillConfig, train_sampler: SamplerConfig,
                        seed: int, log) -> dict | None:
    """Run and write the export when ``settings`` (stage_b_distillation) asks for it; returns
    the summary's ``distillation`` object (None: not asked)."""
    if not settings.enabled or not settings.distill_size:
        log.info("distillation: off (stage_b_distillation.distill_size is not set, or enabled is false)")
        return None
    runner, run_dir = recorder.runner, recorder.run_dir
    chosen = distill_tickets(list(tickets), settings.distill_size, settings.distill_seed)
    spec = rollout_spec("distill", f"{seed}/distill", chosen, guidance,
                        distill_sampler(train_sampler, settings.distill_temperature))
    result = recorder.wait([runner.submit(spec)])[0]
    rows = distill_rows(chosen, result, runner.profile, guidance)
    path = Path(settings.log_chatml_path) if settings.log_chatml_path else run_dir / DISTILL.name
    recorder.write_jsonl(path, rows)
    log.info("distillation: %d of %d tickets exported to %s", len(rows), len(chosen), path)
    return {"path": path.name if path.parent == run_dir else str(path), "tickets": len(chosen),
            "rows": len(rows), "guidance_hash": guidance.hash}
