"""One rule-search iteration (docs/rule_search.md, "One iteration"): ``run_iteration`` returns a frozen
``IterationOutcome``; the loop writes its rows, applies its edit and commits. A train pool's seed key
names its tickets, never the guidance: baseline and candidates draw the same random numbers.
"""

from __future__ import annotations

import json

import msgspec

from ..engine.records import ChatRequest, Decode
from ..stageb import gate as gate_mod
from ..stageb import proposer
from ..stageb.gate import GateResult
from ..stageb.guidance import Guidance, GuidanceError, apply_operation
from ..stageb.hashing import content_hash
from ..stageb.proposer_schema import proposer_schema
from ..stageb.tickets import Ticket
from ..stageb.verdicts import Metrics, compute_metrics
from .. import artifacts
from ..artifact_rows import ProposerAnswerRow, ProposerFailureRow
from . import rows
from .rollout import ChatFailure, RolloutResult, RolloutSpec, rollout_spec
from .rundir import utc_timestamp
from .settings import SearchSettings


class IterationInput(msgspec.Struct, frozen=True, kw_only=True):
    iteration: int
    guidance: Guidance  # the current guidance G
    pool: list[Ticket]  # the train pool, in train-list order
    eval_pool: list[Ticket]  # the fixed eval pool (may be empty)
    rejected_ids: frozenset[str]  # candidates rejected earlier in the run


class Evaluated(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate after its rollouts, the gate and the decision."""

    index: int  # 1-based position in the iteration (upstream candidate_index)
    candidate: proposer.Candidate
    guidance: Guidance  # the previewed guidance after the edit
    reflection_id: str
    gate: GateResult
    train_metrics: Metrics  # the candidate on the train tickets common with the baseline
    # The eval baseline and the candidate on the eval tickets both judged (an overlength drop
    # can differ between them): the eval columns and the eval veto compare these two.
    eval_base_metrics: Metrics | None = None
    eval_metrics: Metrics | None = None
    eval_acc_drop: float | None = None
    decision: str = "rejected"  # promoted | rejected | rejected_eval_veto
    reason: str | None = None
    applied: bool = False


class IterationOutcome(msgspec.Struct, frozen=True, kw_only=True):
    iteration: int
    guidance: Guidance  # the guidance the iteration started from
    pool_keys: list[str]
    base_metrics: Metrics  # the train baseline on the whole pool
    eval_base_metrics: Metrics | None
    example_keys: list[str]  # the tickets shown to the proposer
    candidates: list[Evaluated]
    applied: Evaluated | None  # the edit to apply (one of ``candidates``)
    rejected_ids: list[str]  # this iteration's candidates that were not promoted
    proposers: list[ProposerAnswerRow] = []  # one per proposer call (none: no call)
    rejections: list[str] = []  # why each candidate that never reached the A/B test was rejected
    ablation_note: str | None = None  # why no ablation candidate filled up, when none could

    @property
    def proposer(self) -> ProposerAnswerRow | None:
        return self.proposers[0] if self.proposers else None

    @property
    def new_guidance(self) -> Guidance:
        return self.applied.guidance if self.applied is not None else self.guidance


def train_spec(name: str, settings: SearchSettings, pool, guidance: Guidance) -> RolloutSpec:
    seed_key = f"{settings.seed}/train/{content_hash([t.key for t in pool])}"  # the pool's tickets only
    return rollout_spec(name, seed_key, pool, guidance, settings.rule_search.train_sampler)


def baseline_spec(inp: IterationInput, settings: SearchSettings) -> RolloutSpec:
    return train_spec(f"train/it{inp.iteration}/base", settings, inp.pool, inp.guidance)


def eval_spec(name: str, settings: SearchSettings, eval_pool, guidance: Guidance) -> RolloutSpec:
    return rollout_spec(name, f"{settings.seed}/eval", eval_pool, guidance, settings.rule_search.eval_sampler)


def common_metrics(base_stats: dict, cand_stats: dict) -> tuple[Metrics, Metrics]:
    """Metrics of both rollouts on the tickets present in both (sorted keys)."""
    keys = [k for k in base_stats if k in cand_stats]
    return compute_metrics([base_stats[k] for k in keys]), compute_metrics([cand_stats[k] for k in keys])


def run_iteration(inp: IterationInput, settings: SearchSettings, recorder, log, on_gate=None) -> IterationOutcome:
    """Compute one iteration, appending its hard cases and proposer failures on the way.
    ``on_gate(guidance)`` gets the best passing candidate's guidance before the eval rollouts."""
    rs, it, g, runner = settings.rule_search, inp.iteration, inp.guidance, recorder.runner
    log.info("iteration %d: %d train tickets, guidance step %d (%s)", it, len(inp.pool), g.step, g.hash)
    base = recorder.wait([runner.submit(baseline_spec(inp, settings))])[0]
    recorder.append(artifacts.HARD_CASES.name, rows.hard_case_rows(
        base.stats, iteration=it, sampler="train", limit=max(100, 4 * rs.reflect_size),
        mission=settings.mission, guidance_hash=g.hash, now=utc_timestamp()))
    outcome = IterationOutcome(iteration=it, guidance=g, pool_keys=[t.key for t in inp.pool],
                               base_metrics=compute_metrics(base.stats), eval_base_metrics=None,
                               example_keys=[], candidates=[], applied=None, rejected_ids=[])
    if not base.stats:
        log.warning("iteration %d: every train ticket was dropped as overlength", it)
        return outcome
    examples = proposer.select_examples(base.stats, {t.key: t for t in inp.pool}, rs.reflect_size)
    example_keys = [stats.key for stats, _ in examples]
    requests = proposer_requests(inp, settings, runner.profile, examples)
    chats, eval_base = _propose_and_eval_baseline(inp, settings, recorder, requests)
    for call, chat in enumerate(chats):
        if isinstance(chat, ChatFailure):
            log.warning("iteration %d: proposer call %d failed (%s); no proposer candidates from it", it, call + 1,
                        chat.error)
    failures = Failures(it, settings.mission, len(examples))
    proposed, answers = _merge_proposals(inp, settings, runner, chats, requests, example_keys, failures)
    for call, (chat, answer) in enumerate(zip(chats, answers)):
        if not answer.parsed and not isinstance(chat, ChatFailure):  # a failed call: said above
            which = f" of call {call + 1}" if len(chats) > 1 else ""
            log.warning("iteration %d: the proposer answer%s is unusable (%s); no proposer candidates", it, which,
                        answer.error)
    previews, ablation_note = _previews(inp, settings, proposed, example_keys, failures)
    recorder.append(artifacts.PROPOSER_ANSWERS.name, answers)
    recorder.append(artifacts.PROPOSER_FAILURES.name, failures.rows)
    evaluated = _evaluate(inp, settings, recorder, base, eval_base, previews, on_gate)
    evaluated, applied = _choose(evaluated)
    return msgspec.structs.replace(
        outcome, eval_base_metrics=compute_metrics(eval_base.stats) if eval_base is not None else None,
        example_keys=example_keys, candidates=evaluated, applied=applied,
        rejected_ids=sorted({c.candidate.candidate_id for c in evaluated if c.decision != "promoted"}),
        proposers=answers, rejections=[r.error for r in failures.rows if r.stage in REJECTING_STAGES],
        ablation_note=ablation_note)


REJECTING_STAGES = ("validate", "preview")  # failure rows that are one rejected candidate each


class Failures:

    def __init__(self, iteration: int, mission: str, examples: int):
        self.iteration, self.mission, self.examples = iteration, mission, examples
        self.rows: list[ProposerFailureRow] = []

    def add(self, error: str, *, stage: str, chat=None, raw: str | None = None, **entry) -> None:
        self.rows.append(rows.failure_row(
            iteration=self.iteration, mission=self.mission,
            examples=chat.examples_used if chat is not None else self.examples,
            prompt_tokens=chat.prompt_tokens if chat is not None else None,
            error=error, stage=stage, raw=raw, **entry))


def proposer_requests(inp: IterationInput, settings: SearchSettings, profile, examples) -> list[ChatRequest]:
    """The iteration's ``proposer_calls`` requests (none without examples): one prompt, each
    call with its own seed key derived from the work; the first call's is upstream's."""
    if not examples:
        return []
    first = _proposer_request(inp, settings, profile, examples)
    return [first, *(msgspec.structs.replace(first, seed_key=f"{first.seed_key}/call{call}")
                     for call in range(1, settings.rule_search.proposer_calls))]


def _proposer_request(inp: IterationInput, settings: SearchSettings, profile, examples) -> ChatRequest:
    rs = settings.rule_search
    decode = Decode(temperature=rs.proposer_temperature, top_p=rs.proposer_top_p,
                    max_new_tokens=rs.proposer_max_new_tokens,
                    repetition_penalty=rs.proposer_repetition_penalty, seed=settings.seed)
    prompt = proposer.build_proposer_prompt(settings.proposer_system, settings.mission, inp.guidance, examples,
                                            lang=proposer.proposer_language(profile.verdict))
    schema = None
    if rs.constrain_proposer:
        # Keys stay in the schema's order: llguidance asks for an object's properties in it.
        schema = json.dumps(proposer_schema(inp.guidance, profile.verdict, max_operations=rs.num_candidate_rules),
                            ensure_ascii=False)
    return ChatRequest(**msgspec.structs.asdict(prompt), decode=decode,
                       seed_key=f"{settings.seed}/proposer/it{inp.iteration}",
                       max_prompt_tokens=rs.proposer_max_prompt_tokens, json_schema=schema)


def _propose_and_eval_baseline(inp: IterationInput, settings: SearchSettings, recorder, requests: list[ChatRequest]):
    """One gather: the chats are submitted first, so they start on the first free workers."""
    runner = recorder.runner
    chats = [runner.submit_chat(request) for request in requests]
    ev = (runner.submit(eval_spec(f"eval/it{inp.iteration}/base", settings, inp.eval_pool, inp.guidance))
          if inp.eval_pool else None)
    pendings = [*chats, *([ev] if ev is not None else [])]
    results = recorder.wait(pendings, "proposer") if pendings else []
    return results[:len(chats)], (results[-1] if ev is not None else None)


def _merge_proposals(inp: IterationInput, settings: SearchSettings, runner, chats: list, requests: list[ChatRequest],
                     example_keys: list[str], failures: Failures):
    """Every call's valid candidates in call order, less duplicates; one answer row per call."""
    proposed, answers = [], []
    for call, (chat, request) in enumerate(zip(chats, requests)):
        accepted, answer = _parse_proposals(inp, settings, runner, chat, example_keys,
                                            "\n\n".join(request.examples), failures)
        if len(chats) > 1:
            answer = msgspec.structs.replace(answer, call=call + 1)
        answers.append(answer)
        ids = {c.candidate_id for c in proposed}
        texts = {c.signature for c in proposed if c.op != "remove"}
        for cand in accepted:
            if cand.candidate_id in ids or (cand.op != "remove" and cand.signature in texts):
                failures.add("duplicate of a candidate of an earlier proposer call", stage="validate", chat=chat,
                             op=cand.op, text=cand.text, candidate_id=cand.candidate_id)
                continue
            proposed.append(cand)
            ids.add(cand.candidate_id)
            texts.add(cand.signature)
    return proposed, answers


def _parse_proposals(inp: IterationInput, settings: SearchSettings, runner, chat, example_keys: list[str],
                     examples_text: str, failures: Failures) -> tuple[list[proposer.Candidate], ProposerAnswerRow]:
    """The call's valid candidates and its answer row; each failure or rejection is a failure row."""
    rs = settings.rule_search
    answer = ProposerAnswerRow(iteration=inp.iteration, mission=settings.mission,
                                    constrained=rs.constrain_proposer, parsed=False)
    if isinstance(chat, ChatFailure):
        failures.add(chat.error, stage="generate")
        return [], msgspec.structs.replace(answer, error=f"the proposer call failed: {chat.error}")
    answer = msgspec.structs.replace(
        answer, examples_used=chat.examples_used, prompt_tokens=chat.prompt_tokens, text=chat.text,
        completion_tokens=chat.completion_tokens if chat.text is not None else None,
        finish_reason=chat.finish_reason or None)
    if chat.text is None:
        failures.add("prompt_overlength", stage="prompt", chat=chat)
        return [], msgspec.structs.replace(answer, error="prompt over proposer_max_prompt_tokens even with one example")
    try:
        obj = proposer.extract_json(chat.text)
        accepted, rejections = proposer.parse_candidates(
            obj, inp.guidance, vocab=runner.profile.verdict, rejected_ids=set(inp.rejected_ids),
            limit=rs.num_candidate_rules, evidence=example_keys, examples_text=examples_text)
    except ValueError as err:
        # A cut-off answer often holds a complete inner object that does parse: its error
        # ("neither 'operations' nor 'rules'") would hide the real cause, the budget.
        error = (f"truncated at proposer_max_new_tokens={rs.proposer_max_new_tokens}"
                 if chat.finish_reason == "length" else str(err))
        failures.add(error, stage="parse", chat=chat, raw=chat.text)
        return [], msgspec.structs.replace(answer, error=error)
    for rejection in rejections:
        entry = {k: v for k, v in rejection.items() if k != "reason"}
        failures.add(rejection.get("reason") or "rejected", stage="validate", chat=chat, raw=chat.text, **entry)
    return accepted, msgspec.structs.replace(answer, parsed=True, operations=len(accepted) + len(rejections))


def _previews(inp: IterationInput, settings: SearchSettings, proposed: list, example_keys: list[str],
              failures: Failures) -> tuple[list[tuple], str | None]:
    """``(index, candidate, previewed guidance, reflection id)`` of the proposer candidates,
    then ablation removes up to ``num_candidate_rules``; and why no ablation filled up."""
    g, it = inp.guidance, inp.iteration
    taken = set(inp.rejected_ids) | {c.candidate_id for c in proposed}
    missing = settings.rule_search.num_candidate_rules - len(proposed)
    ablations = proposer.ablation_candidates(g, rejected_ids=taken, limit=missing) if missing > 0 else []
    note = _no_ablation_note(g, inp.rejected_ids) if missing > 0 and not ablations else None
    now = utc_timestamp()
    out = []
    for cand in [*proposed, *ablations]:
        rid = proposer.reflection_id(g.hash, it, cand.candidate_id)
        op = msgspec.structs.replace(cand.operation, evidence=example_keys)
        try:
            preview = apply_operation(g, op, now=now, reflection_id=rid)
        except GuidanceError as err:
            failures.add(f"cannot apply: {err}", stage="preview", candidate_id=cand.candidate_id)
            continue
        out.append((len(out) + 1, cand, preview, rid))
    return out, note


def _no_ablation_note(g: Guidance, rejected_ids) -> str:
    everything = proposer.ablation_candidates(g, limit=len(g.experiences))
    if not everything:
        return "no learnable rule besides G0 to ablate"
    keys = ", ".join(sorted((c.operation.key for c in everything if c.candidate_id in rejected_ids),
                            key=lambda key: (len(key), key)))  # G2 before G10
    return f"ablation of {keys} already rejected earlier in the run" if keys else "ablation candidates proposed already"


def _evaluate(inp: IterationInput, settings: SearchSettings, recorder, base: RolloutResult,
              eval_base: RolloutResult | None, previews: list[tuple], on_gate=None) -> list[Evaluated]:
    if not previews:
        return []
    rs, it, runner = settings.rule_search, inp.iteration, recorder.runner
    pendings = [runner.submit(train_spec(f"train/it{it}/cand{index}", settings, inp.pool, preview))
                for index, _, preview, _ in previews]
    trains = recorder.wait(pendings)
    evaluated = []
    with recorder.phase("gate"):
        for (index, cand, preview, rid), train in zip(previews, trains):
            gate = gate_mod.evaluate_gate(base.stats, train.stats, op=cand.op, gate=rs.gate, iteration=it)
            evaluated.append(Evaluated(
                index=index, candidate=cand, guidance=preview, reflection_id=rid, gate=gate,
                train_metrics=common_metrics(base.stats, train.stats)[1],
                decision="promoted" if gate.passed else "rejected", reason=gate.reason))
    passing = [c for c in evaluated if c.gate.passed]
    if passing and on_gate is not None:
        on_gate(_choose(evaluated)[1].guidance)
    if not passing or eval_base is None:
        return evaluated
    pendings = [runner.submit(eval_spec(f"eval/it{it}/cand{c.index}", settings, inp.eval_pool, c.guidance))
                for c in passing]
    vetted = {c.index: _eval_veto(c, eval_base, result, rs.gate.eval_max_acc_drop)
              for c, result in zip(passing, recorder.wait(pendings))}
    return [vetted.get(c.index, c) for c in evaluated]


def _eval_veto(c: Evaluated, eval_base: RolloutResult, result: RolloutResult, max_drop: float | None) -> Evaluated:
    base_m, cand_m = common_metrics(eval_base.stats, result.stats)
    vetoed, drop = gate_mod.eval_veto(base_m.acc if base_m.n else None, cand_m.acc if cand_m.n else None, max_drop)
    changes = {"eval_base_metrics": base_m, "eval_metrics": cand_m, "eval_acc_drop": drop}
    if vetoed:
        changes.update(decision="rejected_eval_veto", reason=f"eval accuracy drop {drop:.3f} > {max_drop:.3f}")
    return msgspec.structs.replace(c, **changes)


def _choose(evaluated: list[Evaluated]) -> tuple[list[Evaluated], Evaluated | None]:
    """The promoted candidate with the largest RER (earliest on ties), marked ``applied``."""
    promoted = [c for c in evaluated if c.decision == "promoted"]
    best = gate_mod.select_best([c.gate for c in promoted])
    if best is None:
        return evaluated, None
    applied = msgspec.structs.replace(promoted[best], applied=True)
    return [applied if c.index == applied.index else c for c in evaluated], applied
