"""The inputs of a run, for every test that runs one: tickets, seed guidance, proposer prompt, config.

``write_run_inputs(root, records, ...)`` writes the four files a run reads (``tickets.jsonl``,
``guidance.json``, ``proposer.txt``, ``config.yaml``) from one config text, one seed
guidance, one proposer prompt and one seed; its parameters are what tests vary. Two presets
name the two kinds of run the tests make, and differ only where their tests need it:

- ``search_inputs``: the rule search of the scripted engine (and of the simulated engine):
  mode search, 80 ``feature_records``, chunks of 8, one decode with three samples (an odd
  number of votes: a majority never ties). The scripted search's outcome (which edits are
  accepted, in which iteration) follows from these tickets, chunks and samples.
- ``audit_inputs``: the small audits of the fake engine and the tiny model (and the
  one-epoch searches of the fake engine, by ``--set mode=search``): mode audit, 24
  ``missing_part_records``, chunks of 4 (so that 12 tickets reach 3 workers), two decodes
  of two samples, the first with a seed of its own (K = 4 samples a ticket, which the audit
  tests count and order). The tiny model answers in at most 12 tokens here.

Both write the same mission, seed guidance (G0 and the dust rule G1, which the scripted
proposer's first answer repeats), proposer prompt, seed, eval sampler, rule-search settings,
``runner.logging_steps`` (read by audits only) and output place (``<out>/<MISSION>/run``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from doubles.scripted_engine import rule

MISSION = "Cabinet inspection"
SEED = 11
PROPOSER_PROMPT = "You learn inspection rules. Answer with JSON operations only.\n"
SEED_RULES = {"G0": "Check the cabinet for damage.", "G1": rule("dust")}
SEED_GUIDANCE = {MISSION: {"step": 0, "updated_at": "2026-01-01T00:00:00+00:00", "experiences": SEED_RULES}}

# The train samplers of the two presets (the YAML under rule_search.train_sampler).
THREE_SAMPLES = """\
    grid: [{temperature: 0.7, top_p: 0.9, max_new_tokens: 16}]
    samples_per_decode: 3"""
TWO_DECODES_OF_TWO = """\
    grid:
      - {temperature: 0.7, top_p: 0.9, max_new_tokens: 12, seed: 3}
      - {temperature: 0.3, top_p: 0.9, max_new_tokens: 12}
    samples_per_decode: 2"""

# What the two presets set differently (see the module's docstring).
SEARCH = {"mode": "search", "chunk_size": 8, "train_sampler": THREE_SAMPLES}
AUDIT = {"mode": "audit", "chunk_size": 4, "train_sampler": TWO_DECODES_OF_TWO}

CONFIG = """\
seed: {seed}
mode: {mode}
stage_a_paths: tickets.jsonl
model: {{path: {model}}}
prompt: {{profile: generic}}
guidance: {{path: guidance.json}}
output: {{root: {out}, run_name: {run_name}}}
runner: {{epochs: {epochs}, chunk_size: {chunk_size}, logging_steps: 5}}
rule_search:
  proposer_prompt_path: proposer.txt
  reflect_size: 4
  num_candidate_rules: 3
  train_pool_size: {train_pool_size}
  eval_pool_size: 20
  gate:
    min_relative_error_reduction: 0.1
    max_changed_fraction: 0.5
    max_fp_rate_increase: 0.05
    bootstrap: {{iterations: 100, min_prob: 0.8}}
  early_stop: {{patience: 2}}
  train_sampler:
{train_sampler}
  eval_sampler:
    grid: [{{temperature: 0.3, max_new_tokens: 16}}]
{extra}"""


# ----------------------------------------------------------------------------- tickets

def feature_records(n: int = 80, seed: int = 5) -> list[dict]:
    """``n`` Stage-A records for the scripted engine, with hidden features (rust, crack, dust,
    clean) in their summaries; fail iff rust or crack (never mislabelled, so a perfect rule
    set reaches the noise floor)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        feats = [f for f, p in (("rust", 0.2), ("crack", 0.15), ("dust", 0.3), ("clean", 0.35)) if rng.random() < p]
        label = "fail" if ("rust" in feats or "crack" in feats) else "pass"
        per_image = {"image_1": f"cabinet {i} front view" + "".join(f", {f} seen" for f in feats[:1]),
                     "image_2": f"cabinet {i} side view" + "".join(f", {f} seen" for f in feats[1:])}
        rows.append({"mission": MISSION, "group_id": f"CAB-{i:04d}", "label": label, "per_image": per_image})
    return rows


def missing_part_records(n: int = 24) -> list[dict]:
    """``n`` Stage-A records for the fake engine: every third ticket has a missing part and is
    labelled fail. A few are mislabelled so that a FakeEngine run (which judges the text)
    makes both kinds of error: intact but labelled fail (i % 7 == 5: NG, a false release) and
    broken but labelled pass (i % 5 == 3: NP, a false block). Every fifth mentions a scratch."""
    records = []
    for i in range(n):
        broken = i % 3 == 0
        label = "fail" if broken else "pass"
        if i % 7 == 5 and not broken:
            label = "fail"
        if i % 5 == 3 and broken:
            label = "pass"
        per_image = {f"image_{j + 1}": f"cabinet {i} view {j}: bolts present" for j in range(1 + i % 3)}
        if broken:
            per_image["image_1"] = f"cabinet {i}: cover missing, cable loose"
        if i % 5 == 2:
            per_image["image_1"] += ", small scratch on door"
        records.append({"mission": MISSION, "group_id": f"QC-{i:04d}", "label": label, "per_image": per_image})
    return records


# ----------------------------------------------------------------------------- the files

def write_run_inputs(root, records: list[dict], *, mode: str, chunk_size: int, train_sampler: str, out: str = "out",
                     run_name: str = "run", model: str = "tiny", epochs: int = 8, train_pool_size: int = 512,
                     extra: str = "") -> str:
    """Write ``records`` as tickets, the seed guidance (for each mission of ``records``), the
    proposer prompt and the config under ``root``; return the config path. ``out`` is
    ``output.root`` (relative to ``root`` unless absolute); ``extra`` is YAML appended to the
    config (top-level sections the config text does not set)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    missions = dict.fromkeys(r["mission"] for r in records) or [MISSION]
    (root / "guidance.json").write_text(json.dumps({m: SEED_GUIDANCE[MISSION] for m in missions}))
    (root / "proposer.txt").write_text(PROPOSER_PROMPT)
    path = root / "config.yaml"
    path.write_text(CONFIG.format(seed=SEED, mode=mode, model=model, out=out, run_name=run_name, epochs=epochs,
                                  chunk_size=chunk_size, train_pool_size=train_pool_size,
                                  train_sampler=train_sampler, extra=extra))
    return str(path)


def search_inputs(root, *, n_tickets: int = 80, records: list[dict] | None = None, **settings) -> str:
    """The scripted search's inputs: ``feature_records(n_tickets)`` (or ``records``); ``settings``
    as ``write_run_inputs``."""
    records = feature_records(n_tickets) if records is None else records
    return write_run_inputs(root, records, **{**SEARCH, **settings})


def audit_inputs(root, *, n_tickets: int = 24, records: list[dict] | None = None, **settings) -> str:
    """A small audit's inputs: ``missing_part_records(n_tickets)`` (or ``records``); ``settings``
    as ``write_run_inputs``."""
    records = missing_part_records(n_tickets) if records is None else records
    return write_run_inputs(root, records, **{**AUDIT, **settings})
