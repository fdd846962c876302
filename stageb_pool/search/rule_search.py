"""The Stage-B rule search on the pool (upstream 3.3-3.9, its defects fixed; docs/rule_search.md).

One iteration, every GPU busy at each step:

1. train baseline: the iteration's train pool under the current guidance;
2. ONE gather: the proposer call (the ``reflect_size`` most confidently wrong tickets) and
   the eval-pool baseline (served by the runner's cache while the guidance is unchanged);
3. candidates: proposer output extracted and validated (every rejection logged), ablation
   ``remove`` candidates fill up to ``num_candidate_rules``; every candidate's train rollout
   in ONE gather;
4. the gate on the tickets common to baseline and candidate; the passing candidates' eval
   rollouts in ONE gather (optional eval veto);
5. at most one edit (largest RER, earliest on ties); commit: guidance.json, then state.json.

A train pool's rollouts use a seed key that names the pool's tickets, never the guidance:
baseline and candidates draw the same random numbers (common random numbers), and the
accepted candidate's rollout is the next iteration's baseline whenever the pool repeats
(the cache serves it). Only the parent decides and writes; rows are appended in a canonical
order and carry no wall-clock value outside the volatile ``timestamp`` key.
"""

from __future__ import annotations

import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import msgspec

from ..engine.records import ChatRequest, Decode
from ..stageb import gate as gate_mod
from ..stageb import proposer
from ..stageb.guidance import Guidance, GuidanceError, apply_operation, load_guidance
from ..stageb.hashing import content_hash, tickets_hash
from ..stageb.prompts import build_messages
from ..stageb.ticket_pools import TrainPoolSampler, split_eval_pool
from ..stageb.verdicts import compute_metrics
from . import audit, fileio, rundir
from . import state as state_mod
from .rollout import RolloutResult, RolloutSpec
from .rundir import (
    BENCHMARKS,
    CANDIDATES,
    HARD_CASES,
    PROPOSER_FAILURES,
    REGRESSIONS,
    utc_timestamp,
)

DISTILL_DEFAULT = "distill_chatml.jsonl"
RAW_CHARS = 400


def brief(metrics) -> dict | None:
    """The summary's view of a Metrics."""
    if metrics is None:
        return None
    return {"n": metrics.n, "acc": metrics.acc, "fp_rate": metrics.fp_rate, "fn_rate": metrics.fn_rate}


def distill_sampler(train_sampler, temperature: float | None):
    """Upstream 3.9: the train-grid entry at ``temperature`` (None: the lowest train
    temperature), else the closest entry with its temperature replaced; one sample."""
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


class _Cand:
    """One candidate of an iteration as it goes through preview, rollout, gate and decision."""

    __slots__ = ("index", "candidate", "guidance", "reflection_id", "train", "gate", "eval",
                 "eval_acc_drop", "decision", "reason", "applied")

    def __init__(self, index, candidate, guidance, reflection_id):
        self.index = index  # 1-based position in the iteration (upstream candidate_index)
        self.candidate = candidate  # proposer.Candidate
        self.guidance = guidance  # previewed Guidance after the edit
        self.reflection_id = reflection_id
        self.train = None  # RolloutResult on the train pool
        self.gate = None  # gate.GateResult
        self.eval = None  # RolloutResult on the eval pool (gate passes only)
        self.eval_acc_drop = None
        self.decision = "rejected"
        self.reason = None
        self.applied = False


class _Round:
    """Everything one iteration computed, for its rows and its commit."""

    def __init__(self, it, guidance, pool, seed_key):
        self.it = it
        self.g = guidance
        self.pool = pool
        self.seed_key = seed_key
        self.base = None
        self.base_metrics = None
        self.eval_base = None
        self.eval_base_metrics = None
        self.examples = []
        self.candidates: list[_Cand] = []
        self.applied: _Cand | None = None


class RuleSearch:
    """The loop and its state; :meth:`run` returns the summary."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.cfg = ctx.config
        self.rs = ctx.config.rule_search
        self.seed = int(ctx.config.seed)
        self.mission = ctx.mission
        self.run_dir = Path(ctx.run_dir)
        self.runner = ctx.runner
        self.repo = ctx.guidance_repo
        self.log = ctx.log
        self.timing = {"rollout": 0.0, "proposer": 0.0, "gate": 0.0, "io": 0.0}
        self.bootstrap_seed = self.rs.gate.bootstrap.seed  # resolved by load_config
        self.train, self.eval = split_eval_pool(list(ctx.tickets), self.rs.eval_pool_size, self.seed)
        self.proposer_system = ctx.proposer_system
        self.state: state_mod.SearchState | None = None
        self.iterations_this_run = 0

    # -- start / resume ---------------------------------------------------------------------

    def _fresh_state(self) -> state_mod.SearchState:
        g = self.repo.load()
        sampler = TrainPoolSampler.start(len(self.train), self.rs.train_pool_size, self.seed,
                                         fraction=self.rs.train_pool_fraction)
        return state_mod.SearchState(
            iteration=0, guidance_hash=g.hash, guidance_step=g.step, guidance=msgspec.to_builtins(g),
            no_gain=0, rejected_ids=[], sampler=sampler, config_hash=state_mod.config_identity(self.cfg),
            tickets_hash=tickets_hash(self.ctx.tickets),  # run order: what a resume must reproduce
            artifacts={name: 0 for name in state_mod.APPEND_ARTIFACTS},
            config=state_mod.config_document(self.cfg),
        )

    def _start(self) -> state_mod.SearchState:
        """A fresh state; on resume the committed one, with the run dir brought back to it."""
        committed = state_mod.load_state(self.run_dir) if self.ctx.resume else None
        if committed is None:
            # Nothing committed (a new run, or a resume of a run killed in iteration 1,
            # whose guidance.json may already hold iteration 1's edit): start from the seed
            # guidance with empty artifacts.
            if self.ctx.resume:
                self.repo.write(load_guidance(self.cfg.guidance.path, self.mission))
            fresh = self._fresh_state()
            state_mod.truncate_artifacts(self.run_dir, fresh.artifacts)
            return fresh
        state_mod.check_resumable(committed, config=self.cfg, tickets=self.ctx.tickets, run_dir=self.run_dir)
        for name, n in state_mod.truncate_artifacts(self.run_dir, committed.artifacts).items():
            self.log.info("resume: dropped %d bytes of uncommitted rows from %s", n, name)
        self._restore_guidance(committed)
        self.log.info("resume: continuing after iteration %d (guidance step %d, %s)",
                      committed.iteration, committed.guidance_step, committed.guidance_hash)
        return committed

    def _restore_guidance(self, st: state_mod.SearchState) -> None:
        """guidance.json is written before state.json, so a kill between the two leaves it one
        step ahead of the commit. The state's copy is the committed truth: put it back (the
        redone iteration rewrites the same snapshot file)."""
        current = self.repo.load() if self.repo.exists() else None
        if current is not None and current.hash == st.guidance_hash and current.step == st.guidance_step:
            return
        self.log.warning("resume: guidance.json is not the committed step %d; restoring it", st.guidance_step)
        self.repo.write(msgspec.convert(st.guidance, Guidance))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        started = time.monotonic()
        st = self.state = self._start()
        while st.stop_reason is None:
            if st.iteration >= self.cfg.runner.epochs:
                st.stop_reason = "epochs"
                break
            self._iteration(st.iteration + 1)
        g = self.repo.load()  # the final guidance
        distill = self._distill(g)
        summary = self._summary(g, distill, time.monotonic() - started)
        print_summary(summary)
        return summary

    @contextmanager
    def _phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.timing[name] += time.monotonic() - t0

    def _append(self, name: str, rows: list[dict]) -> None:
        if rows:
            with self._phase("io"):
                fileio.append_jsonl(self.run_dir / name, rows)

    def _wait(self, pendings: list, phase: str = "rollout") -> list:
        with self._phase(phase):
            results = self.runner.wait(pendings)
        if self.runner.save_rollouts:
            self._save_rollouts(results)
        return results

    def _save_rollouts(self, results: list) -> None:
        """``output.save_rollouts``: every rollout's candidate texts in rollouts/<name>.jsonl
        (whole files, rewritten identically when a resumed run redoes an iteration)."""
        with self._phase("io"):
            for result in results:
                if isinstance(result, RolloutResult):
                    fileio.write_jsonl(rundir.rollouts_path(self.run_dir, result.spec_name),
                                       audit.rollout_rows(result))

    def _spec(self, name: str, seed_key: str, tickets, guidance: dict, sampler) -> RolloutSpec:
        return RolloutSpec(name=name, seed_key=seed_key, tickets=list(tickets), guidance=dict(guidance),
                           sampler=sampler)

    def _train_spec(self, rnd: _Round, name: str, guidance: dict) -> RolloutSpec:
        return self._spec(f"train/it{rnd.it}/{name}", rnd.seed_key, rnd.pool, guidance, self.rs.train_sampler)

    def _eval_spec(self, name: str, guidance: dict) -> RolloutSpec:
        return self._spec(name, f"{self.seed}/eval", self.eval, guidance, self.rs.eval_sampler)

    def _next_pool(self) -> list:
        """The next train pool in train-list order, so a pool holding the same tickets is the
        same rollout (same chunks, same seed key) and the cache can serve it."""
        return [self.train[i] for i in sorted(self.state.sampler.next_pool())]

    def pool_seed_key(self, tickets) -> str:
        """The pool's identity: run seed + the hash of its ticket keys (not the guidance)."""
        return f"{self.seed}/train/{content_hash([t.key for t in tickets])}"

    def _iteration(self, it: int) -> None:
        pool = self._next_pool()
        rnd = _Round(it, self.repo.load(), pool, self.pool_seed_key(pool))
        self.log.info("iteration %d: %d train tickets, guidance step %d (%s)", it, len(pool), rnd.g.step, rnd.g.hash)
        rnd.base = self._wait([self.runner.submit(self._train_spec(rnd, "base", rnd.g.experiences))])[0]
        rnd.base_metrics = compute_metrics(rnd.base.stats)
        self._append(HARD_CASES, audit.hard_case_rows(
            rnd.base.stats, iteration=it, sampler="train", limit=max(100, 4 * self.rs.reflect_size),
            mission=self.mission, guidance_hash=rnd.g.hash, now=utc_timestamp()))
        if not self.state.first_pool:
            self.state.first_pool = [t.key for t in pool]
        if rnd.base.stats:
            tickets = {t.key: t for t in pool}
            rnd.examples = proposer.select_examples(rnd.base.stats, tickets, self.rs.reflect_size)
            chat = self._propose_and_eval_baseline(rnd)
            rnd.candidates = self._candidates(rnd, self._parse_proposals(rnd, chat))
            self._evaluate(rnd)
            rnd.applied = self._choose(rnd)
            self._log_candidates(rnd)
            if rnd.applied is not None:
                self._apply(rnd)
        else:
            self.log.warning("iteration %d: every train ticket was dropped as overlength", it)
        self._commit(rnd)

    # -- proposer + eval baseline -----------------------------------------------------------

    def _proposer_request(self, rnd: _Round):
        rs = self.rs
        decode = Decode(temperature=rs.proposer_temperature, top_p=rs.proposer_top_p,
                        max_new_tokens=rs.proposer_max_new_tokens,
                        repetition_penalty=rs.proposer_repetition_penalty, seed=self.seed)
        prompt = proposer.build_proposer_prompt(self.proposer_system, self.mission, rnd.g, rnd.examples,
                                                lang=proposer.proposer_language(self.runner.profile.verdict))
        return ChatRequest(**msgspec.structs.asdict(prompt), decode=decode, seed_key=f"{self.seed}/proposer/it{rnd.it}",
                           max_prompt_tokens=rs.proposer_max_prompt_tokens)

    def _propose_and_eval_baseline(self, rnd: _Round):
        """One gather: the proposer call and the eval baseline share the workers. The chat is
        submitted first, so it starts at once on the first free worker."""
        chat = self.runner.submit_chat(self._proposer_request(rnd)) if rnd.examples else None
        ev = self.runner.submit(self._eval_spec(f"eval/it{rnd.it}/base", rnd.g.experiences)) if self.eval else None
        pendings = [p for p in (chat, ev) if p is not None]
        results = self._wait(pendings, "proposer") if pendings else []
        if ev is not None:
            rnd.eval_base = results[-1]
            rnd.eval_base_metrics = compute_metrics(rnd.eval_base.stats)
        return results[0] if chat is not None else None

    def _failure_row(self, rnd: _Round, error: str, *, chat=None, raw: str | None = None, **extra) -> dict:
        row = {"timestamp": utc_timestamp(), "iteration": rnd.it, "mission": self.mission,
               "examples": chat.examples_used if chat is not None else len(rnd.examples),
               "prompt_tokens": chat.prompt_tokens if chat is not None else None, "error": error}
        row.update(extra)
        if raw is not None:
            row["raw_response_prefix"] = raw[:RAW_CHARS]
            row["raw_response_suffix"] = raw[-RAW_CHARS:]
        return row

    def _parse_proposals(self, rnd: _Round, chat) -> list:
        """The proposer's valid candidates; every failure and rejection becomes a row of
        rule_search_proposer_failures.jsonl with its reason."""
        if chat is None:
            return []
        rows, accepted = [], []
        if chat.text is None:
            rows.append(self._failure_row(rnd, "prompt_overlength", chat=chat, stage="prompt"))
        else:
            try:
                obj = proposer.extract_json(chat.text)
                accepted, rejections = proposer.parse_candidates(
                    obj, rnd.g, vocab=self.runner.profile.verdict, rejected_ids=set(self.state.rejected_ids),
                    limit=self.rs.num_candidate_rules, evidence=[example_key(e) for e in rnd.examples])
            except ValueError as err:
                rows.append(self._failure_row(rnd, str(err), chat=chat, raw=chat.text, stage="parse"))
            else:
                for rejection in rejections:
                    extra = {k: v for k, v in dict(rejection).items() if k not in ("reason", "error")}
                    reason = rejection.get("reason") or rejection.get("error") or "rejected"
                    rows.append(self._failure_row(rnd, reason, chat=chat, raw=chat.text, stage="validate", **extra))
        self._append(PROPOSER_FAILURES, rows)
        return accepted

    def _candidates(self, rnd: _Round, proposed: list) -> list[_Cand]:
        """Proposer candidates, then ablation removes up to ``num_candidate_rules``, each with
        its previewed guidance; a candidate whose edit cannot apply is logged and skipped."""
        taken = set(self.state.rejected_ids) | {c.candidate_id for c in proposed}
        missing = self.rs.num_candidate_rules - len(proposed)
        ablations = proposer.ablation_candidates(rnd.g, rejected_ids=taken, limit=missing) if missing > 0 else []
        evidence = [example_key(e) for e in rnd.examples]
        now = utc_timestamp()
        out, rows = [], []
        for cand in [*proposed, *ablations]:
            rid = proposer.reflection_id(rnd.g.hash, rnd.it, cand.candidate_id)
            op = msgspec.structs.replace(cand.operation, evidence=evidence)
            try:
                preview = apply_operation(rnd.g, op, now=now, reflection_id=rid)
            except GuidanceError as err:
                rows.append(self._failure_row(rnd, f"cannot apply: {err}", stage="preview",
                                              candidate_id=cand.candidate_id))
                continue
            out.append(_Cand(len(out) + 1, cand, preview, rid))
        self._append(PROPOSER_FAILURES, rows)
        return out

    # -- A/B evaluation ---------------------------------------------------------------------

    def _evaluate(self, rnd: _Round) -> None:
        """All candidates' train rollouts in one gather, the gate, then the passing ones' eval
        rollouts in one gather."""
        cands = rnd.candidates
        if not cands:
            return
        pendings = [self.runner.submit(self._train_spec(rnd, f"cand{c.index}", c.guidance.experiences))
                    for c in cands]
        for c, result in zip(cands, self._wait(pendings)):
            c.train = result
        with self._phase("gate"):
            for c in cands:
                c.gate = gate_mod.evaluate_gate(rnd.base.stats, c.train.stats, op=c.candidate.op,
                                                gate=self.rs.gate, iteration=rnd.it,
                                                bootstrap_seed=self.bootstrap_seed)
                c.decision = "promoted" if c.gate.passed else "rejected"
                c.reason = c.gate.reason
        passing = [c for c in cands if c.gate.passed]
        if passing and rnd.eval_base is not None:
            pendings = [self.runner.submit(self._eval_spec(f"eval/it{rnd.it}/cand{c.index}", c.guidance.experiences))
                        for c in passing]
            for c, result in zip(passing, self._wait(pendings)):
                c.eval = result
                self._eval_veto(rnd, c)

    def _eval_veto(self, rnd: _Round, c: _Cand) -> None:
        base_m, cand_m = common_metrics(rnd.eval_base.stats, c.eval.stats)
        vetoed, drop = gate_mod.eval_veto(base_m.acc if base_m.n else None, cand_m.acc if cand_m.n else None,
                                          self.rs.gate.eval_max_acc_drop)
        c.eval_acc_drop = drop
        if vetoed:
            c.decision = "rejected_eval_veto"
            c.reason = f"eval accuracy drop {drop:.3f} > {self.rs.gate.eval_max_acc_drop:.3f}"

    def _choose(self, rnd: _Round) -> _Cand | None:
        """The promoted candidate with the largest RER (earliest on ties). Rejected ids are
        remembered for the rest of the run (upstream forgot them)."""
        promoted = [c for c in rnd.candidates if c.decision == "promoted"]
        best = gate_mod.select_best([c.gate for c in promoted])
        rejected = {c.candidate.candidate_id for c in rnd.candidates if c.decision != "promoted"}
        self.state.rejected_ids = sorted(set(self.state.rejected_ids) | rejected)
        if best is None:
            return None
        promoted[best].applied = True
        return promoted[best]

    # -- rows ------------------------------------------------------------------------------

    def _identity(self, c: _Cand) -> dict:
        cand = c.candidate
        return {"signature": cand.signature, "candidate_id": cand.candidate_id, "op": cand.op,
                "target_signature": cand.target_signature,
                "target_signatures": list(cand.target_signatures or [])}

    def _log_candidates(self, rnd: _Round) -> None:
        """One rule_candidates.jsonl row per evaluated candidate (upstream fields plus the gate
        statistics, the reason and both guidance hashes) and its regressions row."""
        cand_rows, regression_rows = [], []
        base_m = rnd.base_metrics
        eval_m = rnd.eval_base_metrics
        for c in rnd.candidates:
            gr = c.gate
            _, cand_m = common_metrics(rnd.base.stats, c.train.stats)
            ev_cand = common_metrics(rnd.eval_base.stats, c.eval.stats)[1] if c.eval is not None else None
            row = {"timestamp": utc_timestamp(), "iteration": rnd.it, "candidate_index": c.index, "mission": self.mission,
                   **self._identity(c),
                   "text": c.candidate.text, "rationale": c.candidate.rationale, "source": c.candidate.source,
                   "train_n": base_m.n, "base_acc": base_m.acc,
                   "base_false_release_rate": base_m.false_release_rate,
                   "base_false_block_rate": base_m.false_block_rate,
                   "cand_acc": cand_m.acc, "cand_false_release_rate": cand_m.false_release_rate,
                   "cand_false_block_rate": cand_m.false_block_rate,
                   "eval_n": eval_m.n if eval_m else 0,
                   "eval_base_acc": eval_m.acc if eval_m else None,
                   "eval_base_false_release_rate": eval_m.false_release_rate if eval_m else None,
                   "eval_base_false_block_rate": eval_m.false_block_rate if eval_m else None,
                   "eval_cand_acc": ev_cand.acc if ev_cand else None,
                   "eval_cand_false_release_rate": ev_cand.false_release_rate if ev_cand else None,
                   "eval_cand_false_block_rate": ev_cand.false_block_rate if ev_cand else None,
                   "decision": c.decision, "applied": c.applied, "reason": c.reason,
                   "n_common": gr.n_common, "relative_error_reduction": gr.relative_error_reduction,
                   "changed_fraction": gr.changed_fraction, "bootstrap_prob": gr.bootstrap_prob,
                   "base_fp_rate": gr.base_fp_rate, "cand_fp_rate": gr.cand_fp_rate,
                   "d_fp_rate": gr.d_fp_rate, "d_acc": gr.d_acc, "eval_acc_drop": c.eval_acc_drop,
                   "regression_count": gr.regression_count,
                   "base_guidance_hash": rnd.g.hash, "cand_guidance_hash": c.guidance.hash,
                   "reflection_id": c.reflection_id}
            cand_rows.append(row)
            if gr.regression_count:
                regression_rows.append({
                    "timestamp": utc_timestamp(), "iteration": rnd.it, "candidate_index": c.index,
                    "mission": self.mission, **self._identity(c), "decision": c.decision,
                    "regression_count": gr.regression_count, "regressions": list(gr.regressions),
                    "base_guidance_hash": rnd.g.hash, "cand_guidance_hash": c.guidance.hash})
        self._append(CANDIDATES, cand_rows)
        self._append(REGRESSIONS, regression_rows)

    # -- apply + commit ---------------------------------------------------------------------

    def _apply(self, rnd: _Round) -> None:
        """Snapshot, write the previewed guidance (step + 1), benchmarks.jsonl row."""
        c = rnd.applied
        g_new = c.guidance
        with self._phase("io"):
            self.repo.snapshot_and_write(g_new)
        base_m = rnd.base_metrics
        _, after = common_metrics(rnd.base.stats, c.train.stats)
        eval_m = rnd.eval_base_metrics
        eval_after = common_metrics(rnd.eval_base.stats, c.eval.stats)[1] if c.eval is not None else None
        new_keys = [k for k in g_new.experiences if k not in rnd.g.experiences]
        row = {"timestamp": utc_timestamp(), "iteration": rnd.it, "mission": self.mission,
               "accepted_key": new_keys[0] if c.candidate.op == "upsert" and new_keys else None,
               **self._identity(c), "text": c.candidate.text, "rationale": c.candidate.rationale,
               "train_n": base_m.n,
               **{f"base_{k}": getattr(base_m, k) for k in ("acc", "fn_rate", "fp_rate", "fn_over_tp", "fp_over_tp")},
               **{f"after_{k}": getattr(after, k) for k in ("acc", "fn_rate", "fp_rate", "fn_over_tp", "fp_over_tp")},
               "eval_n": eval_m.n if eval_m else 0, "eval_base_acc": eval_m.acc if eval_m else None,
               "eval_after_acc": eval_after.acc if eval_after else None, "eval_acc_drop": c.eval_acc_drop,
               "relative_error_reduction": c.gate.relative_error_reduction,
               "changed_fraction": c.gate.changed_fraction, "bootstrap_prob": c.gate.bootstrap_prob,
               "guidance_step_before": rnd.g.step, "guidance_step_after": g_new.step,
               "reflect_ticket_keys": [example_key(e) for e in rnd.examples],
               "reflection_id": c.reflection_id,
               "base_guidance_hash": rnd.g.hash, "guidance_hash": g_new.hash}
        self._append(BENCHMARKS, [row])
        self.state.edits.append({"iteration": rnd.it, "candidate_id": c.candidate.candidate_id,
                                 "op": c.candidate.op, "relative_error_reduction": c.gate.relative_error_reduction,
                                 "guidance_step": g_new.step, "guidance_hash": g_new.hash})
        self.log.info("iteration %d: applied %s (RER %.3f) -> guidance step %d", rnd.it,
                      c.candidate.candidate_id, c.gate.relative_error_reduction, g_new.step)

    def _commit(self, rnd: _Round) -> None:
        """End of iteration: the state.json commit (guidance.json was written before it)."""
        st = self.state
        if rnd.it == 1 or not st.baseline:
            st.baseline = {"train": brief(rnd.base_metrics),
                           "eval": brief(rnd.eval_base_metrics)}
        st.no_gain = 0 if rnd.applied is not None else st.no_gain + 1
        g = rnd.applied.guidance if rnd.applied is not None else rnd.g
        st.iteration = rnd.it
        st.guidance_hash, st.guidance_step, st.guidance = g.hash, g.step, msgspec.to_builtins(g)
        if st.no_gain >= self.rs.early_stop.patience:
            st.stop_reason = "early_stop"
        with self._phase("io"):
            st.artifacts = state_mod.artifact_lengths(self.run_dir)
            state_mod.write_state(self.run_dir, st)
        self.iterations_this_run += 1

    # -- after the loop ---------------------------------------------------------------------

    def _final_metrics(self, g: Guidance) -> dict:
        """Final guidance on the first train pool (same seed key: the comparison with the
        baseline is paired) and on the eval pool; both usually come from the cache."""
        out = {"train": None, "eval": None}
        pendings = []
        if self.state.first_pool:
            by_key = {t.key: t for t in self.train}
            pool = [by_key[k] for k in self.state.first_pool]
            pendings.append(("train", self.runner.submit(
                self._spec("final/train", self.pool_seed_key(pool), pool, g.experiences, self.rs.train_sampler))))
        if self.eval and self.state.iteration:
            pendings.append(("eval", self.runner.submit(self._eval_spec("final/eval", g.experiences))))
        if pendings:
            results = self._wait([p for _, p in pendings])
            for (name, _), result in zip(pendings, results):
                out[name] = brief(compute_metrics(result.stats))
        return out

    def _distill(self, g: Guidance) -> dict | None:
        """Distillation export, ONCE after the loop with the final guidance (upstream ran it
        after every non-stopping iteration)."""
        dc = self.cfg.stage_b_distillation
        if not dc.enabled or not dc.distill_size:
            return None
        tickets = list(self.ctx.tickets)
        rng = random.Random(dc.distill_seed)  # resolved by load_config
        if dc.distill_size >= len(tickets):
            rng.shuffle(tickets)
        else:
            tickets = rng.sample(tickets, dc.distill_size)
        sampler = distill_sampler(self.rs.train_sampler, dc.distill_temperature)
        result = self._wait([self.runner.submit(self._spec("distill", f"{self.seed}/distill", tickets,
                                                           g.experiences, sampler))])[0]
        profile = self.runner.profile
        rows = []
        for t in tickets:
            s = result.stats.get(t.key)
            if s is None or not s.verdicts or s.verdicts[0] is None:
                continue
            word = profile.verdict.pass_text if s.verdicts[0] == "pass" else profile.verdict.fail_text
            messages = build_messages(profile, g.experiences, t.text())
            messages = [*messages, {"role": "assistant", "content": f"Verdict: {word}\nReason: {s.reasons[0]}"}]
            rows.append({"ticket_key": t.key, "group_id": t.group_id, "mission": t.mission, "label": t.label,
                         "messages": messages})
        path = Path(dc.log_chatml_path) if dc.log_chatml_path else self.run_dir / DISTILL_DEFAULT
        with self._phase("io"):
            fileio.write_jsonl(path, rows)
        self.log.info("distillation: %d of %d tickets exported to %s", len(rows), len(tickets), path)
        return {"path": path.name if path.parent == self.run_dir else str(path), "tickets": len(tickets),
                "rows": len(rows), "guidance_hash": g.hash}

    def _summary(self, g: Guidance, distill: dict | None, wall_s: float) -> dict:
        st = self.state
        final = self._final_metrics(g)
        return {
            "mode": "search",
            "mission": self.mission,
            "iterations": st.iteration,
            "stop_reason": st.stop_reason,
            "edits_accepted": len(st.edits),
            "edits": list(st.edits),
            "guidance_step": g.step,
            "guidance_hash": g.hash,
            "train_pool": {"n_train": len(self.train), "size": st.sampler.size},
            "eval_pool": {"n": len(self.eval)},
            "baseline": st.baseline or {"train": None, "eval": None},
            "final": final,
            "rejected_candidates": len(st.rejected_ids),
            "distillation": distill,
            # Counted in this process: a resumed run regenerates what its predecessor's cache held.
            "generations_done": self.runner.generations_done,
            "generations_saved": self.runner.generations_saved,
            # Volatile (wall clock). job.write_summary adds wall_s/rollout_s and `workers`.
            "timing": {**{f"{k}_s": round(v, 3) for k, v in self.timing.items()}, "search_s": round(wall_s, 3),
                       "iterations_this_process": self.iterations_this_run,
                       "resumed": bool(self.ctx.resume)},
        }


# -- helpers ---------------------------------------------------------------------------------

def example_key(example) -> str:
    """Ticket key of a proposer example (a ``(TicketStats, Ticket)`` pair of select_examples)."""
    return example[0].key


def common_metrics(base_stats: dict, cand_stats: dict):
    """Metrics of both rollouts on the tickets present in both (sorted keys)."""
    keys = [k for k in base_stats if k in cand_stats]
    return compute_metrics([base_stats[k] for k in keys]), compute_metrics([cand_stats[k] for k in keys])


def print_summary(summary: dict) -> None:
    """A few human lines on stdout (the full record is summary.json)."""
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
    print("\n".join(lines), file=sys.stdout, flush=True)


def run_search(ctx) -> dict:
    """Run the rule search on ``ctx`` (a job.RunContext); returns the summary (also written
    to summary.json and printed)."""
    return RuleSearch(ctx).run()
