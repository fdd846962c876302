"""The Stage-B rule search's loop and its commit (docs/rule_search.md): per iteration the rows,
the edit, the decision row, then ``state.json``, the one point a ``--resume`` continues from;
after the loop the distillation export, the final metrics and the summary."""

from __future__ import annotations

import logging
import time

import msgspec

from .. import artifacts
from ..stageb.guidance import Guidance
from ..stageb.ticket_pools import split_eval_pool
from . import decisions, fileio, rows
from . import state as state_mod
from .distill import export_distillation
from .iteration import IterationInput, IterationOutcome, run_iteration
from .speculation import Speculation
from .recorder import Recorder
from .run_format import redo_warning
from .settings import RunIdentity, SearchSettings
from .summary import brief, final_metrics, print_summary, search_summary


class RuleSearch:
    """The loop and its state; :meth:`run` returns the summary (printed). The committed guidance
    is held in memory and only written to ``store``: the file is read on resume only."""

    def __init__(self, *, runner, store, run_dir, tickets: list, seed_guidance: Guidance,
                 settings: SearchSettings, identity: RunIdentity, resume: state_mod.ResumePoint | None = None,
                 log: logging.Logger | None = None, headroom: dict | None = None, speculate: bool = False,
                 on_commit=None):
        self.settings = settings
        self.identity = identity
        self.tickets = list(tickets)
        self.seed_guidance = seed_guidance
        self.store = store
        self.resume = resume
        self.log = log or logging.getLogger("stageb_pool")
        self.recorder = Recorder(run_dir, runner)
        self.run_dir = self.recorder.run_dir
        self.train, self.eval = split_eval_pool(self.tickets, settings.rule_search.eval_pool_size, settings.seed)
        self.state: state_mod.SearchState | None = None
        self.guidance: Guidance = seed_guidance  # the committed guidance; set again by _start
        self.iterations_this_run = 0
        self.headroom = headroom  # the judge-headroom check's summary entry, reported as it is
        self.on_commit = on_commit  # called after each commit (the report draws the committed rows' charts)
        # One worker is never idle while the loop waits: speculation could only delay it.
        self.speculation = Speculation(runner, settings, enabled=speculate and runner.pool.size > 1)

    def _fresh_state(self) -> state_mod.SearchState:
        g = self.guidance = self.seed_guidance  # what job (or _start on resume) wrote to guidance.json
        sampler = state_mod.start_sampler(len(self.train), self.settings.rule_search, self.settings.seed)
        return state_mod.SearchState(
            iteration=0, guidance_hash=g.hash, guidance_step=g.step, guidance=msgspec.to_builtins(g),
            no_gain=0, rejected_ids=[], sampler=sampler, config_hash=self.identity.config_hash,
            tickets_hash=self.identity.tickets_hash,
            artifacts={name: 0 for name in state_mod.APPEND_ARTIFACTS}, config=self.identity.config,
        )

    def _start(self) -> state_mod.SearchState:
        """A fresh state; on resume the committed one, with the run dir brought back to it."""
        resume = self.resume
        if resume is not None and resume.state is not None and not resume.continued:
            self.log.warning("%s", redo_warning(resume.state))
        if resume is None or not resume.continued:
            # A new run, or a resume killed in iteration 1 (guidance.json may hold its edit) or with
            # iterations to redo: back to the seed guidance and empty artifacts.
            if resume is not None:
                self.store.write(self.seed_guidance)
                fileio.remove(self.run_dir / artifacts.STATE.name)
            fresh = self._fresh_state()
            state_mod.truncate_artifacts(self.run_dir, fresh.artifacts)
            return fresh
        committed = resume.state
        self.recorder.runner.continue_counts(committed.chunks_used, committed.generations_done,
                                             committed.generations_saved)
        for name, n in state_mod.truncate_artifacts(self.run_dir, committed.artifacts).items():
            self.log.info("resume: dropped %d bytes of uncommitted rows from %s", n, name)
        self._restore_guidance(committed)
        if committed.stop_reason == "epochs" and committed.iteration < self.settings.epochs:
            # runner.epochs is not part of the identity: raising it extends a finished run.
            self.log.info("resume: extending the run from %d to %d iterations", committed.iteration,
                          self.settings.epochs)
            committed.stop_reason = None
        self.log.info("resume: continuing after iteration %d (guidance step %d, %s)",
                      committed.iteration, committed.guidance_step, committed.guidance_hash)
        return committed

    def _restore_guidance(self, st: state_mod.SearchState) -> None:
        """guidance.json is written before state.json, so a kill between the two leaves it one
        step ahead: the state's copy is the committed truth, put back (validate_state refused
        any other mismatch). ``self.guidance`` becomes what the file holds (its one read)."""
        current = self.store.load() if self.store.exists() else None
        if current is not None and current.hash == st.guidance_hash and current.step == st.guidance_step:
            self.guidance = current
            return
        self.log.warning("resume: guidance.json is not the committed step %d; restoring it", st.guidance_step)
        self.guidance = msgspec.convert(st.guidance, Guidance)
        self.store.write(self.guidance)

    def run(self) -> dict:
        started = time.monotonic()
        st = self.state = self._start()
        while st.stop_reason is None:
            if st.iteration >= self.settings.epochs:
                st.stop_reason = "epochs"
                break
            inp = self._next_input(st)
            self.speculation.ahead(self._speculated_input(st, inp, inp.guidance))
            outcome = run_iteration(inp, self.settings, self.recorder, self.log, on_gate=lambda g: (
                self.speculation.retarget(self._speculated_input(st, inp, g))))
            self._record(outcome)
            self._commit(outcome)
            self.speculation.settle(self._speculated_input(st, inp, self.guidance, decided=True))
        self.speculation.settle(None)
        return self._finish(time.monotonic() - started)

    def _next_input(self, st: state_mod.SearchState) -> IterationInput:
        """The next train pool in train-list order, so a pool holding the same tickets is the
        same rollout (same chunks, same seed key) and the cache can serve it."""
        pool = [self.train[i] for i in sorted(st.sampler.next_pool())]
        return IterationInput(iteration=st.iteration + 1, guidance=self.guidance, pool=pool,
                              eval_pool=self.eval, rejected_ids=frozenset(st.rejected_ids))

    def _speculated_input(self, st: state_mod.SearchState, inp: IterationInput, guidance: Guidance, *,
                          decided: bool = False) -> IterationInput | None:
        """The iteration after ``inp`` if ``inp`` ends with ``guidance`` (the next pool, from a
        copy of the sampler: pools never depend on decisions), or None when none would follow.
        ``decided``: ``inp`` is committed (``st`` is after it), else it is running."""
        if decided:
            if st.stop_reason is not None or st.iteration >= self.settings.epochs:
                return None
        elif inp.iteration >= self.settings.epochs or (
                guidance is inp.guidance and st.no_gain + 1 >= self.settings.rule_search.early_stop.patience):
            return None
        pool = [self.train[i] for i in sorted(msgspec.structs.replace(st.sampler).next_pool())]
        return IterationInput(iteration=inp.iteration + 1, guidance=guidance, pool=pool, eval_pool=self.eval,
                              rejected_ids=inp.rejected_ids)

    def _record(self, outcome: IterationOutcome) -> None:
        """The outcome's rows; an edit's snapshot, guidance.json and benchmark row; the decision."""
        mission = self.settings.mission
        self.recorder.append(artifacts.CANDIDATES.name, rows.candidate_rows(outcome, mission))
        self.recorder.append(artifacts.REGRESSIONS.name, rows.regression_rows(outcome, mission))
        c = outcome.applied
        if c is not None:
            with self.recorder.phase("io"):
                self.store.snapshot_and_write(self.guidance, c.guidance)
            self.recorder.append(artifacts.BENCHMARKS.name, [rows.benchmark_row(outcome, mission)])
        decision = decisions.iteration_row(outcome, mission)
        self.recorder.append(artifacts.ITERATIONS.name, [decision])
        self.log.info("%s", decisions.iteration_line(decision))

    def _commit(self, outcome: IterationOutcome) -> None:
        """The state.json commit; rejected ids are remembered for the rest of the run."""
        st, c = self.state, outcome.applied
        if not st.first_pool:
            st.first_pool = list(outcome.pool_keys)
        if outcome.iteration == 1 or not st.baseline:
            st.baseline = msgspec.convert({"train": brief(outcome.base_metrics),
                                           "eval": brief(outcome.eval_base_metrics)}, state_mod.Baseline)
        st.rejected_ids = sorted(set(st.rejected_ids) | set(outcome.rejected_ids))
        if c is not None:
            st.edits.append(state_mod.Edit(
                iteration=outcome.iteration, candidate_id=c.candidate.candidate_id, op=c.candidate.op,
                relative_error_reduction=c.gate.relative_error_reduction, guidance_step=c.guidance.step,
                guidance_hash=c.guidance.hash))
        st.no_gain = 0 if c is not None else st.no_gain + 1
        g = self.guidance = outcome.new_guidance
        st.iteration = outcome.iteration
        st.guidance_hash, st.guidance_step, st.guidance = g.hash, g.step, msgspec.to_builtins(g)
        if st.no_gain >= self.settings.rule_search.early_stop.patience:
            st.stop_reason = "early_stop"
        runner = self.recorder.runner
        st.generations_done, st.generations_saved = runner.run_done, runner.run_saved
        st.chunks_used = sorted(runner.chunks_used)
        with self.recorder.phase("io"):
            st.artifacts = state_mod.artifact_lengths(self.run_dir)
            state_mod.write_state(self.run_dir, st)
        self.iterations_this_run += 1
        if self.on_commit is not None:
            self.on_commit()

    def _finish(self, wall_s: float) -> dict:
        """Distillation (once, with the final guidance), final metrics, the summary."""
        st, settings = self.state, self.settings
        g = self.guidance  # the final guidance
        distillation = export_distillation(self.recorder, tickets=self.tickets, guidance=g,
                                           settings=settings.distill,
                                           train_sampler=settings.rule_search.train_sampler,
                                           seed=settings.seed, log=self.log)
        by_key = {t.key: t for t in self.train}
        final = final_metrics(self.recorder, settings, g, first_pool=[by_key[k] for k in st.first_pool],
                              eval_pool=self.eval, iterations=st.iteration)
        runner = self.recorder.runner
        timing = {**{f"{k}_s": round(v, 3) for k, v in self.recorder.seconds.items()},
                  "speculation": runner.speculation_summary(),
                  "search_s": round(wall_s, 3), "iterations_this_process": self.iterations_this_run,
                  "generations_done_this_process": runner.generations_done,
                  "generations_saved_this_process": runner.generations_saved, "resumed": self.resume is not None}
        summary = search_summary(st, settings, g, final=final, distillation=distillation, n_train=len(self.train),
                                 n_eval=len(self.eval), runner=self.recorder.runner, timing=timing,
                                 headroom=self.headroom)
        # Read back, not kept in memory: a resumed run explains the iterations of every process.
        iterations = fileio.read_jsonl(self.run_dir / artifacts.ITERATIONS.name)
        summary["why"] = decisions.run_sentence(iterations, edits=len(st.edits), stop_reason=st.stop_reason,
                                                headroom=summary.get("judge_headroom"))
        print_summary(summary)
        return summary


def check_resume(run_dir, *, tickets: list, settings: SearchSettings, identity: RunIdentity,
                 store) -> state_mod.ResumePoint:
    """Where a ``--resume`` of the search of ``tickets`` starts, checked against the train keys
    and start sampler of its own split; read-only."""
    train, _ = split_eval_pool(tickets, settings.rule_search.eval_pool_size, settings.seed)
    return state_mod.check_resume(run_dir, identity, train_keys=[t.key for t in train], store=store,
                                  start_sampler=state_mod.start_sampler(len(train), settings.rule_search,
                                                                        settings.seed))
