"""The parent's own work per pool task, without the machine's noise.

    .venv/bin/python bench/parent_replay.py                   # 64 workers, 8 replays
    .venv/bin/python bench/parent_replay.py --count --top 30  # + Python opcodes and calls per task

One small-workload row of ``bench/loop_scaling.py`` (fork, ``--workers``, time scale 0.25)
runs first and records every rollout the search submits and every result its workers return.
The same rollouts are then replayed in this process, now quiet, through the real
``RolloutRunner``, ``Pool`` and ``Dispatcher``, with an in-process transport that answers each
task with its recorded result, one result per turn of the event loop (as at 64 workers, where
about one result wakes the parent). No system call, no wake-up, no other process runs: what
the parent's Python costs warm. Printed:

- ``live``: the row's parent dispatch µs per task (its CPU inside the rollout runner's submit and
  wait, as in ``loop_scaling.py``), which adds the select, recv and send calls and the cold
  caches after each wake-up of a busy 2-core machine;
- ``replay``: the replay's CPU µs per task, min and median of ``--reps``;
- with ``--count``: Python opcodes and calls per task, counted with ``sys.settrace`` (the same on
  any machine and any day: compare code with it), and the functions that execute the most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import loop_scaling  # noqa: E402  (the bench folder is not a package)
import msgspec  # noqa: E402

from stageb_pool import Pool  # noqa: E402
from stageb_pool.pool import Fork, Inline, protocol  # noqa: E402
from stageb_pool.pool.backend import plan_devices  # noqa: E402
from stageb_pool.pool.dispatch import Dispatcher, WorkerMessage, WorkerStarted  # noqa: E402
from stageb_pool.pool.protocol import Ready, Result, Task  # noqa: E402
from stageb_pool.search.rollout import RolloutRunner  # noqa: E402


class Recording:
    """The rollouts a row submits (in order, with the runner's settings) and each task's result,
    keyed by what the task sent (its item and shared keys): a replay's task finds its answer."""

    def __init__(self):
        self.specs: list = []
        self.runner: RolloutRunner | None = None
        self.results: dict[tuple, bytes] = {}
        self._sent: dict[int, tuple] = {}

    def record(self, root: Path, workers: int) -> dict:
        submit, send, reply = RolloutRunner.submit, Dispatcher._send_task, Dispatcher._on_reply

        def record_submit(runner, spec):
            self.specs.append(spec)
            self.runner = self.runner or runner
            return submit(runner, spec)

        def record_send(dispatcher, slot, task):
            self._sent[task.id] = _task_key(task.item, task.shared)
            return send(dispatcher, slot, task)

        def record_reply(dispatcher, slot, message):
            if isinstance(message, Result) and message.id in self._sent:
                self.results[self._sent[message.id]] = bytes(message.value)
            return reply(dispatcher, slot, message)

        RolloutRunner.submit, Dispatcher._send_task, Dispatcher._on_reply = record_submit, record_send, record_reply
        try:
            return loop_scaling.run_row(root, "small", "fork", workers, 0.25, None)
        finally:
            RolloutRunner.submit, Dispatcher._send_task, Dispatcher._on_reply = submit, send, reply


def _task_key(item, shared: dict) -> tuple:
    return bytes(item), tuple(sorted(shared.items()))


class RecordedAnswers:
    """A dispatcher transport whose workers answer from a ``Recording``, one answer per ``poll``.
    Its own work (what a worker would do) is timed apart, to be left out of the parent's."""

    def __init__(self, recording: Recording, size: int):
        self.recording = recording
        self.events: list = []
        self.todo: list[tuple[int, bytes]] = []  # (rank, frames the parent sent)
        self.worker_readers = [protocol.FrameReader() for _ in range(size)]
        self.parent_readers = [protocol.FrameReader() for _ in range(size)]
        self.worker_s = 0.0

    def spawn(self, rank: int) -> None:
        self.events.append(WorkerStarted(rank, 1000 + rank))
        ready = protocol.frame(Ready(version=protocol.PROTOCOL_VERSION, pid=1000 + rank))
        self.events += [WorkerMessage(rank, m) for m in self.parent_readers[rank].feed(ready)]

    def send(self, rank: int, data: bytes) -> None:
        self.todo.append((rank, data))

    def cancel(self, rank: int, task_id: int) -> None:
        raise AssertionError("a replay cancels nothing (it runs no speculation)")

    def kill(self, rank: int) -> None:
        raise AssertionError("a replay kills no worker")

    def close(self, busy) -> None:
        pass

    def poll(self, timeout):
        events, self.events = self.events, []
        if self.todo:
            rank, data = self.todo.pop(0)
            events += [WorkerMessage(rank, m) for m in self.parent_readers[rank].feed(self._answer(rank, data))]
        return events

    def _answer(self, rank: int, data: bytes) -> bytes:
        tracer = sys.gettrace()
        sys.settrace(None)  # a worker's work is not the parent's: neither timed nor counted
        started = time.thread_time()
        try:
            frames = []
            for body in self.worker_readers[rank].bodies(data):
                message = protocol.decode_request(bytes(body))
                if isinstance(message, Task):
                    raw = self.recording.results[_task_key(message.item, message.shared)]
                    frames.append(protocol.frame(Result(id=message.id, value=msgspec.Raw(raw))))
            return b"".join(frames)
        finally:
            self.worker_s += time.thread_time() - started
            sys.settrace(tracer)


def replay(recording: Recording, workers: int) -> tuple[float, int, float]:
    """The recorded rollouts once more: (parent CPU seconds, tasks, the answering's seconds)."""
    model = recording.runner
    pool = Pool(lambda device: None, "cpu:1", backend=Inline())  # only its Python: its dispatcher is replaced
    answers = RecordedAnswers(recording, workers)
    pool._dispatcher = Dispatcher(answers, plan_devices(Fork(), f"cpu:{workers}"), pool.stats,
                                  task_timeout=None, start_timeout=None, max_restarts=0, max_frame=pool.max_frame)
    pool.size, pool.stats.items, pool.stats.busy_s = workers, [0] * workers, [0.0] * workers
    pool._dispatcher.start()
    runner = RolloutRunner(pool, model.profile, chunk_size=model.chunk_size, save_rollouts=model.save_rollouts,
                           engine_key=model.engine_key)
    tasks_before = pool.stats.tasks_sent
    started = time.thread_time()
    for spec in recording.specs:
        runner.run(spec)
    return time.thread_time() - started - answers.worker_s, pool.stats.tasks_sent - tasks_before, answers.worker_s


def count(recording: Recording, workers: int, top: int) -> None:
    opcodes: dict[tuple, int] = {}
    calls = 0

    def trace(frame, event, arg):
        nonlocal calls
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            where = (code.co_filename.rpartition("stageb_pool/")[2], code.co_firstlineno, code.co_name)
            opcodes[where] = opcodes.get(where, 0) + 1
        elif event == "call":
            calls += 1
        return trace

    sys.settrace(trace)
    try:
        _, tasks, _ = replay(recording, workers)
    finally:
        sys.settrace(None)
    print(f"opcodes per task: {sum(opcodes.values()) / tasks:.0f}; Python calls per task: {calls / tasks:.1f}")
    for (path, line, name), n in sorted(opcodes.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {n / tasks:7.1f}  {path}:{line} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64, help="fork workers of the recorded row")
    parser.add_argument("--reps", type=int, default=8, help="replays timed (min and median printed)")
    parser.add_argument("--count", action="store_true", help="count Python opcodes and calls per task too")
    parser.add_argument("--top", type=int, default=20, help="functions listed with --count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loop_scaling.write_inputs(root, loop_scaling.WORKLOADS["small"]["tickets"])
        recording = Recording()
        row = recording.record(root, args.workers)
    print(f"live ({args.workers} fork workers): {row['parent_us_per_item']} µs per task over {row['items']} tasks")
    seconds = []
    for _ in range(args.reps):
        cpu, tasks, _ = replay(recording, args.workers)
        seconds.append(cpu / tasks * 1e6)
    print(f"replay ({tasks} tasks): min {min(seconds):.1f} µs, median {statistics.median(seconds):.1f} µs per task")
    if args.count:
        count(recording, args.workers, args.top)


if __name__ == "__main__":
    main()
