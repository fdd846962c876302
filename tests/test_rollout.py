"""The rollout runner over a real Pool (inline and forked CPU workers) with the fake engine."""

from __future__ import annotations

import io
import json
import logging
import threading

import msgspec
import pytest
import tqdm
from doubles.fake_engine import FakeEngine, fake_factory
from doubles.run_inputs import MISSION, missing_part_records

from stageb_pool import Pool
from stageb_pool.pool import Fork, Inline
from stageb_pool.app.config import SamplerConfig
from stageb_pool.app.progress import Progress
from stageb_pool.engine.records import ChatRequest, ChatResult, Decode
from stageb_pool.search.rollout import RolloutRunner, RolloutSpec
from stageb_pool.stageb.hashing import content_hash
from stageb_pool.stageb.prompts import load_profile
from stageb_pool.stageb.tickets import parse_ticket_line

SAMPLER = SamplerConfig(grid=[Decode(temperature=0.7, seed=3), Decode(temperature=0.3)], samples_per_decode=2)
K = 4  # samples per ticket
GUIDANCE = {"G0": "Check every cabinet for missing or loose parts."}


@pytest.fixture(scope="module")
def tickets():
    return [parse_ticket_line(json.dumps(r)) for r in missing_part_records(10)]


@pytest.fixture(scope="module")
def profile():
    return load_profile("generic", mission=MISSION)


def spec(tickets, name="audit", guidance=GUIDANCE, seed_key="17/audit", sampler=SAMPLER):
    return RolloutSpec(name=name, seed_key=seed_key, tickets=list(tickets), guidance=dict(guidance), sampler=sampler,
                       guidance_hash=content_hash(dict(guidance)))


def items_total(pool) -> int:
    return sum(pool.stats.items)


def expected_majority(ticket) -> str:
    return "fail" if any("missing" in v for v in ticket.per_image.values()) else "pass"


@pytest.mark.parametrize("gpus,inline", [("cpu:1", True), ("cpu:2", False)])
def test_results_in_ticket_order_with_votes(tickets, profile, gpus, inline):
    with Pool(fake_factory(), gpus, backend=Inline() if inline else Fork()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=3)
        result = runner.run(spec(tickets))
    assert list(result.stats) == [t.key for t in tickets]
    assert list(result.rollouts) == [t.key for t in tickets]
    for t in tickets:
        s = result.stats[t.key]
        assert s.gt_label == t.label
        assert s.total_samples == K and s.invalid_count == 0
        assert s.majority == expected_majority(t)
    assert result.generations == len(tickets) * K
    assert result.cached_generations == 0
    assert result.dropped == {}
    assert len(result.chunk_done_s) == 4  # 10 tickets in chunks of 3


def test_same_results_on_one_or_two_workers(tickets, profile):
    outs = []
    for gpus, inline in (("cpu:1", True), ("cpu:2", False)):
        with Pool(fake_factory(flip=0.5), gpus, backend=Inline() if inline else Fork()) as pool:
            result = RolloutRunner(pool, profile, chunk_size=3, save_rollouts=True).run(spec(tickets))
        outs.append((msgspec.to_builtins(result.stats), msgspec.to_builtins(result.rollouts)))
    assert outs[0] == outs[1]
    verdicts = [v for s in outs[0][0].values() for v in s["verdicts"]]
    assert "pass" in verdicts and "fail" in verdicts  # the noise really drew both


def test_chunks_carry_their_cost_and_the_longest_start_first(tickets, profile):
    short, long = tickets[:3], [msgspec.structs.replace(t, per_image={"image_1": "x" * 5000}) for t in tickets[3:6]]
    with Pool(fake_factory(), "cpu:1") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=3)
        pending = runner.submit(spec(short + long))
        costs = [task.cost for task in runner._inflight.values()]
        assert costs[1] > costs[0] > 0
        prompt_chars = sum(sum(len(v) for v in t.per_image.values()) + len(GUIDANCE["G0"]) for t in short)
        assert costs[0] == prompt_chars * K  # (summaries + guidance) per ticket, times the samples
        result = runner.wait([pending])[0]
    assert list(result.stats) == [t.key for t in short + long]
    assert result.chunk_done_s[1] < result.chunk_done_s[0]  # one worker: the costly chunk ran first


def test_cache_hit_generates_nothing(tickets, profile):
    with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        first = runner.run(spec(tickets))
        done = items_total(pool)
        again = runner.run(spec(tickets, name="eval/it2/base"))
        assert items_total(pool) == done  # no task reached a worker
    assert again.generations == 0
    assert again.cached_generations == len(tickets) * K
    assert msgspec.to_builtins(again.stats) == msgspec.to_builtins(first.stats)
    assert runner.generations_done == len(tickets) * K
    assert runner.generations_saved == len(tickets) * K


def test_different_guidance_or_seed_key_is_generated(tickets, profile):
    rule = dict(GUIDANCE, G1="Fail if scratch on the door.")
    with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        base = runner.run(spec(tickets))
        cand = runner.run(spec(tickets, name="cand", guidance=rule))
        other = runner.run(spec(tickets, name="other", seed_key="17/eval"))
    assert cand.generations == other.generations == len(tickets) * K
    assert cand.guidance_hash != base.guidance_hash
    scratched = [t.key for t in tickets if any("scratch" in v for v in t.per_image.values())]
    assert scratched
    for key in scratched:
        assert cand.stats[key].majority == "fail"
    assert any(base.stats[k].majority == "pass" for k in scratched)


def test_dropped_tickets_excluded_and_counted(tickets, profile):
    drop = {tickets[1].key, tickets[7].key}
    with Pool(fake_factory(drop_keys=drop), "cpu:1", backend=Inline()) as pool:
        result = RolloutRunner(pool, profile, chunk_size=3).run(spec(tickets))
    assert set(result.dropped) == drop
    assert all(n > 0 for n in result.dropped.values())
    assert list(result.stats) == [t.key for t in tickets if t.key not in drop]
    assert result.generations == (len(tickets) - 2) * K


def test_dropped_tickets_are_named_in_one_warning_per_phase(tickets, profile, caplog):
    drop = {tickets[1].key, tickets[7].key}
    with Pool(fake_factory(drop_keys=drop), "cpu:1", backend=Inline()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=3)
        with caplog.at_level(logging.WARNING, logger="stageb_pool"):
            runner.wait([runner.submit(spec(tickets, name="train")),
                         runner.submit(spec(tickets, name="candidate", guidance={"G0": "Look for rust."}))])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("train +1 more: 2 ticket(s) dropped, never judged")
    assert all(key in warnings[0] for key in drop)


def test_overlength_tickets_dropped_by_max_prompt_tokens(tickets, profile):
    from doubles.fake_engine import prompt_tokens

    lengths = {t.key: prompt_tokens(t.text(), GUIDANCE) for t in tickets}
    limit = sorted(lengths.values())[len(tickets) // 2]
    sampler = msgspec.structs.replace(SAMPLER, max_prompt_tokens=limit)
    with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
        result = RolloutRunner(pool, profile, chunk_size=3).run(spec(tickets, sampler=sampler))
    assert result.dropped == {k: n for k, n in lengths.items() if n > limit}
    assert set(result.stats) == {k for k, n in lengths.items() if n <= limit}


def test_invalid_samples_counted(tickets, profile):
    bad = tickets[2].key
    with Pool(fake_factory(invalid_keys={bad}), "cpu:1", backend=Inline()) as pool:
        result = RolloutRunner(pool, profile, chunk_size=3).run(spec(tickets))
    s = result.stats[bad]
    assert s.majority is None and s.invalid_count == K and s.verdicts == [None] * K


def test_shared_values_sent_once_per_worker(tickets, profile):
    rule = dict(GUIDANCE, G1="Fail if scratch on the door.")
    with Pool(fake_factory(), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=1)
        runner.wait([runner.submit(spec(tickets)), runner.submit(spec(tickets, name="c", guidance=rule))])
        sends = pool.stats.shared_sends
        assert items_total(pool) == 2 * len(tickets)
    # three distinct shared values (2 guidances, 1 profile), at most once to each of 2 workers,
    # for 20 chunks
    assert 3 <= sends <= 6


def test_a_candidate_sends_the_items_of_its_baseline(tickets, profile):
    """A baseline and its candidates judge the same chunks (the guidance is a shared value):
    each chunk is encoded once, and the workers get the very same item bytes."""
    rule = dict(GUIDANCE, G1="Fail if scratch on the door.")
    with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
        items = []
        real_submit = pool.submit
        pool.submit = lambda method, item, **kw: items.append(item) or real_submit(method, item, **kw)
        runner = RolloutRunner(pool, profile, chunk_size=3)
        base, cand = runner.wait([runner.submit(spec(tickets)), runner.submit(spec(tickets, name="c", guidance=rule))])
        other = runner.run(spec(tickets, name="other pool", seed_key="17/other"))
    chunks = len(base.chunk_done_s)
    assert len(items) == 3 * chunks
    assert all(a is b for a, b in zip(items[:chunks], items[chunks:2 * chunks]))
    assert all(a != b for a, b in zip(items, items[2 * chunks:]))  # another seed key: other items
    assert base.stats != cand.stats and set(other.stats) == set(base.stats)


def test_tickets_are_credited_to_the_worker_that_ran_them(tickets, profile):
    with Pool(fake_factory(), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=2)
        runner.run(spec(tickets))
        runner.run(spec(tickets))  # cached: nobody ran it again
        assert sum(runner.tickets_by_rank.values()) == len(tickets)
        assert set(runner.tickets_by_rank) <= {0, 1}
        assert [runner.tickets_by_rank.get(r, 0) for r in (0, 1)] == [2 * n for n in pool.stats.items]


def test_one_gather_for_rollouts_and_chat(tickets, profile):
    request = ChatRequest(system="s", user_head="h", examples=["a", "b"], user_tail="t",
                          decode=Decode(temperature=0.4), seed_key="17/proposer/it1")
    with Pool(fake_factory(chat_text='{"operations": [{"op": "upsert"}]}'), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        gathers = []
        real_gather = pool.gather
        pool.gather = lambda tasks, **kw: gathers.append(len(tasks)) or real_gather(tasks, **kw)
        a = runner.submit(spec(tickets, name="base"))
        b = runner.submit(spec(tickets, name="twin"))  # same chunks: generated once, shared
        c = runner.submit_chat(request)
        ra, rb, rc = runner.wait([a, b, c])
    assert gathers == [3 + 1]  # 3 chunks (shared by both specs) + the chat, in ONE gather
    assert isinstance(rc, ChatResult) and rc.text.startswith('{"operations"') and rc.examples_used == 2
    assert ra.generations == len(tickets) * K and ra.cached_generations == 0
    assert rb.generations == 0 and rb.cached_generations == len(tickets) * K
    assert msgspec.to_builtins(ra.stats) == msgspec.to_builtins(rb.stats)
    with pytest.raises(ValueError):
        runner.wait([a])


def test_engine_answering_wrong_tickets_is_an_error(tickets, profile):
    class Shuffler(FakeEngine):
        def rollout(self, chunk, **kw):
            result = super().rollout(chunk, **kw)
            return msgspec.structs.replace(result, tickets=result.tickets[::-1])

    with Pool(lambda device: Shuffler(device), "cpu:1", backend=Inline()) as pool:
        with pytest.raises(RuntimeError, match="answered tickets"):
            RolloutRunner(pool, profile, chunk_size=3).run(spec(tickets))


def test_verdict_probabilities_come_in_ticket_order_from_the_runners_chunks(tickets, profile):
    with Pool(fake_factory(drop_keys={tickets[4].key}), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=3)
        scored = runner.verdict_probabilities(tickets, GUIDANCE, None, label="headroom", phase="judge headroom")
        assert sum(pool.stats.items) == 4  # 10 tickets in chunks of 3
    assert [s.key for s in scored] == [t.key for t in tickets]
    assert [s.dropped for s in scored] == [i == 4 for i in range(len(tickets))]
    assert sum(runner.tickets_by_rank.values()) == len(tickets)


def test_engine_scoring_wrong_tickets_is_an_error(tickets, profile):
    class Shuffler(FakeEngine):
        def verdict_probabilities(self, chunk, **kw):
            result = super().verdict_probabilities(chunk, **kw)
            return msgspec.structs.replace(result, tickets=result.tickets[::-1])

    with Pool(lambda device: Shuffler(device), "cpu:1", backend=Inline()) as pool:
        with pytest.raises(RuntimeError, match="verdict chunk 0 answered tickets"):
            RolloutRunner(pool, profile, chunk_size=3).verdict_probabilities(tickets, GUIDANCE, None,
                                                                              label="headroom", phase="h")


def test_progress_log_lines_without_terminal(tickets, profile, caplog):
    log = logging.getLogger("test.progress")
    progress = Progress(stream=io.StringIO(), log=log, interval_s=1e9, every_chunks=2)
    assert not progress.tty
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
            RolloutRunner(pool, profile, chunk_size=3, progress=progress).run(spec(tickets))
    lines = [r.getMessage() for r in caplog.records]
    # 4 chunks: a line after chunks 2 and 4; the one after chunk 4 is the final line (not repeated)
    assert len(lines) == 2
    assert lines[-1].startswith("audit: 10/10 tickets (100%)")
    assert "tickets/s" in lines[0] and lines[0].startswith("audit: 6/10")


def test_progress_bar_on_terminal_starts_no_thread():
    stream = io.StringIO()
    before = threading.active_count()
    progress = Progress(stream=stream, tty=True, log=logging.getLogger("test.bar"),
                        stats_fn=lambda: {0: 3, 1: 1})
    progress.start("train/it1", 8)
    progress.advance(4)
    progress.advance(4)
    assert progress.line().startswith("train/it1: 8/8 tickets")
    assert progress._bar.n == 8
    progress.finish()
    assert threading.active_count() == before
    assert tqdm.tqdm.monitor is None
    assert "train/it1" in stream.getvalue() and "ticket" in stream.getvalue()


def test_progress_share_per_worker():
    counts = {0: 10, 1: 10}
    progress = Progress(stream=io.StringIO(), tty=False, stats_fn=lambda: counts)
    progress.start("x", 4)
    counts[0] += 3
    counts[1] += 1
    progress.advance(4)
    assert progress.line().endswith("workers 0:75% 1:25%")


def test_engine_error_propagates_and_runner_stays_usable(tickets, profile):
    from stageb_pool import WorkerError

    with Pool(fake_factory(fail_on=tickets[4].key), "cpu:1", backend=Inline()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=3)
        with pytest.raises(WorkerError, match="told to fail"):
            runner.run(spec(tickets))
        ok = runner.run(spec(tickets[:3], name="first chunk only"))  # chunk 0 has no bad ticket
        assert list(ok.stats) == [t.key for t in tickets[:3]]
        assert ok.generations == 0  # chunk 0 finished before the failure and stayed cached
        with pytest.raises(WorkerError):  # the failed chunk is tried again, not awaited forever
            runner.run(spec(tickets))


def test_progress_final_line_when_last_chunk_was_not_logged(caplog):
    log = logging.getLogger("test.final")
    progress = Progress(stream=io.StringIO(), tty=False, log=log, interval_s=1e9, every_chunks=100)
    with caplog.at_level(logging.INFO, logger="test.final"):
        progress.start("eval", 5)
        progress.advance(3)
        progress.advance(2)
        progress.finish()
        progress.finish()  # idempotent: nothing more
    assert [r.getMessage()[:16] for r in caplog.records] == ["eval: 5/5 ticket"]


def test_the_runs_counts_continue_across_processes_while_the_process_counts_start_over(tickets, profile):
    """A resumed run continues the run's counts from state.json: a chunk the interrupted
    process already used counts as saved, though this process generates it again."""
    with Pool(fake_factory(), "cpu:1", backend=Inline()) as pool:
        first = RolloutRunner(pool, profile, chunk_size=4)
        first.run(spec(tickets))
        first.run(spec(tickets))
        resumed = RolloutRunner(pool, profile, chunk_size=4)
        resumed.continue_counts(first.chunks_used, first.run_done, first.run_saved)
        resumed.run(spec(tickets))
    n = len(tickets) * K
    assert (first.run_done, first.run_saved) == (first.generations_done, first.generations_saved) == (n, n)
    assert (resumed.generations_done, resumed.generations_saved) == (n, 0)  # generated again here
    assert (resumed.run_done, resumed.run_saved) == (n, 2 * n)  # as one uninterrupted process would count


def test_speculated_work_is_claimed_by_the_same_submit_and_counted_there(tickets, profile):
    request = ChatRequest(system="s", user_head="h", examples=["a"], user_tail="t",
                          decode=Decode(temperature=0.4), seed_key="17/proposer/it2")
    with Pool(fake_factory(chat_text="{}"), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        ahead = runner.speculate(spec(tickets, name="train/it2/base"))
        runner.speculate_chat(request)
        while runner.peek(ahead) is None:  # one turn of the event loop: idle workers take speculative tasks
            pool._advance([])
        items = items_total(pool)
        base, chat = runner.wait([runner.submit(spec(tickets, name="train/it2/base")), runner.submit_chat(request)])
        assert items_total(pool) <= items + 1  # no chunk ran again: at most the chat was still to run
        assert isinstance(chat, ChatResult) and chat.text == "{}"
    assert base.generations == len(tickets) * K and base.cached_generations == 0  # generated by its claimer
    assert runner.generations_done == len(tickets) * K and runner.run_done == len(tickets) * K
    summary = runner.speculation_summary()
    assert summary["used"] >= 3 and summary["used"] + summary["claimed_unstarted"] == 3 + 1  # the chunks ran ahead
    assert summary["discarded"] == 0


def test_a_discarded_speculation_stops_on_the_workers_that_run_it(tickets, profile):
    # Each chunk takes a minute unless cancelled: the proposer call after the discard would
    # wait that long for a worker.
    request = ChatRequest(system="s", user_head="h", examples=["a"], user_tail="t",
                          decode=Decode(temperature=0.4), seed_key="17/proposer/it2")
    with Pool(fake_factory(chat_text="{}", rollout_s=60), "cpu:2", task_timeout=120) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        wrong = runner.speculate(spec(tickets, name="train/it2/base"))
        # the chat runs on one worker, a speculative chunk on the other, then one on the first
        assert runner.wait([runner.submit_chat(request)])[0].text == "{}"
        assert pool.stats.tasks_sent == 3  # the chat and two of the three chunks
        runner.discard([part.key for part in wrong.parts])
        assert runner.wait([runner.submit_chat(request)])[0].text == "{}"
    summary = runner.speculation_summary()
    assert summary["discarded"] == 3 and summary["wasted_worker_s"] < 30  # two stopped, one never ran


def test_discarded_speculation_leaves_no_trace_in_the_cache_or_the_counts(tickets, profile):
    with Pool(fake_factory(), "cpu:2") as pool:
        runner = RolloutRunner(pool, profile, chunk_size=4)
        wrong = runner.speculate(spec(tickets, name="train/it2/base"))
        while runner.peek(wrong) is None:  # one turn of the event loop
            pool._advance([])
        runner.discard([part.key for part in wrong.parts])
        result = runner.run(spec(tickets, name="train/it2/base"))  # generated again, as if never speculated
    assert result.generations == len(tickets) * K
    summary = runner.speculation_summary()
    assert (summary["used"], summary["discarded"]) == (0, 3) and summary["wasted_worker_s"] > 0
