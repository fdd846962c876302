"""Engines for the pool's own tests: plain methods that ``Pool.map`` calls by name.

For the worker pool itself (tests/test_pool.py, test_ray.py, test_ray_faults.py and the
driver scripts in tests/pool_scripts/): dispatch, order, shared snapshots, faults, restarts,
signals and output, on the fork and the Ray backend. ``Engine`` squares, echoes, blocks,
dies once, prints; ``Uniform`` reports the same ``info()`` on every worker (the Ray backend
refuses workers whose engines differ) and ``OddOne`` does not; ``ExitsWhileStarting``,
``FailingEngine`` and ``StartsWhenTheParentLeaves`` fail or stall while the engine starts.
``touch`` and ``wait_for_path`` are the file signals the tests and these engines share.

How they differ from the other doubles: they know nothing of tickets, guidance or the
engine protocol (rollout, chat, verdict probabilities) that the fake engine
(``fake_engine``) and the scripted engine (``scripted_engine``) speak for the audit and the
rule search; and since the scripts and the Ray workers import them in processes of their
own, they import nothing but the standard library and msgspec.

Nothing here sleeps to synchronise: methods that must wait poll for a condition (a file)
with a deadline, and methods that must "hang" block until they are killed.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import msgspec


class Echoed(msgspec.Struct, frozen=True):
    item: object
    shared: dict
    rank: int


def wait_for_path(path: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.005)
    return False


def touch(path: str, text: str = "") -> None:
    """Create ``path`` atomically so a reader never sees it half written."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Engine:
    def __init__(self, device):
        self.device = device

    def info(self):
        return {"rank": self.device.rank, "device": self.device.name}

    def square(self, x, *, guidance=None):
        return x * x

    def jitter_square(self, x):
        # uneven durations shuffle completion order across workers (workload, not sync)
        time.sleep((x * 7 % 5) / 1000)
        return x * x

    def echo(self, item, **shared):
        return {"item": item, "shared": shared, "rank": self.device.rank}

    def pid(self, _=None):
        return os.getpid()

    def fail_on(self, x, *, bad=2):
        if x == bad:
            raise ValueError(f"item {x} is bad")
        return x

    def wait_for(self, path):
        return wait_for_path(path)

    def big(self, n):
        return "x" * n

    def block(self, marker):
        """Announce that the task started, then block until killed."""
        touch(f"{marker}.{os.getpid()}", str(os.getpid()))
        threading.Event().wait()

    def until_cancelled(self, limit):
        """What an engine that can stop early does: wait ``limit`` seconds unless the parent
        cancels the task first (then ``TaskCancelled``); False if it never did."""
        from stageb_pool.pool import cancellation  # in the method: this module imports only the standard library

        cancellation.sleep(limit)
        return False

    def die_once(self, x, *, marker, how="kill"):
        """Die (or hang) the first time item 3 is run; a retry computes normally."""
        if x == 3 and not os.path.exists(marker):
            touch(marker)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit":
                os._exit(3)
            if how == "hang":
                threading.Event().wait()
        return x * x

    def hold_once(self, x, *, marker):
        """The first time item 3 is run, announce it (``marker`` holds this process's pid) and
        block until killed (the test takes the node away); a retry computes normally."""
        if x == 3 and not os.path.exists(marker):
            touch(marker, str(os.getpid()))
            threading.Event().wait()
        return x * x

    def sum_shared(self, x, **shared):
        return x + sum(shared.values())

    def exit_with(self, code):
        os._exit(code)

    def print_lines(self, text):
        print(text)
        print("to stderr", file=__import__("sys").stderr)
        return True

    def progress_bar(self, steps):
        """What tqdm writes: one line redrawn with carriage returns, a newline at the end."""
        import sys

        for n in range(steps + 1):
            sys.stderr.write(f"\rconverting: {n}/{steps}")
            sys.stderr.flush()
        sys.stderr.write("\n")
        return True


class Uniform(Engine):
    """The test engine with the same info() on every worker (the Ray backend refuses workers
    whose engines differ)."""

    def info(self):
        return {"engine": "test", "kind": self.device.kind}

    def sleep(self, seconds):
        time.sleep(seconds)  # the workload itself (a simulated generation), not synchronisation
        return seconds


class OddOne(Uniform):
    """Worker 1 reports other software, as a node with another torch would."""

    def info(self):
        return {**super().info(), "torch": "2.12.0" if self.device.rank == 1 else "2.13.0"}


class ExitsWhileStarting:
    """A process that dies while its engine loads (an OOM kill, a crash in a native library)."""

    def __init__(self, device):
        os._exit(5)


class StartsWhenTheParentLeaves:
    """An engine whose start ends only once the parent has closed this worker's socket, so
    that the worker's Ready meets a closed socket, as when Ctrl-C hits a run whose models
    are still loading. Touches ``<marker>.<pid>`` when its start begins."""

    def __init__(self, device, marker: str):
        touch(f"{marker}.{os.getpid()}")
        sockets = [int(fd) for fd in os.listdir("/proc/self/fd") if _is_socket(int(fd))]
        (fd,) = sockets  # a worker keeps only its own socket
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)  # the peer closed (not: data arrived)
        poller.poll(20_000)


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


class FailingEngine:
    def __init__(self, device):
        raise RuntimeError(f"no model for {device.name}")
