"""The zygote: a fork server the parent forks once, while it is still clean, which forks every
worker and replacement, passes the parent each worker's socket, reaps them, relays their
output with a ``[w<rank> <device>] `` prefix and stops them on Shutdown. Why and how:
docs/architecture.md, "Process model".
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time

from . import protocol
from .fork import fork_child
from .errors import PoolError
from .protocol import Exited, Kill, Shutdown, Spawn, Spawned
from .worker import worker_main


class Zygote:
    def __init__(self, devices, engine_factory, max_frame: int):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.pid = fork_child(lambda: ForkServer(theirs, devices, engine_factory, max_frame).run(),
                                  keep=(theirs.fileno(),), check_safe=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.status: int | None = None

    def spawn(self, rank: int) -> None:
        try:
            protocol.send_packet(self.sock, Spawn(rank))
        except OSError:
            raise PoolError(self.death_message()) from None

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Ask the zygote to signal its child (it knows whether the pid is still its own: never a
        recycled one). A zygote that is gone took its workers with it: quiet, never an error that
        would hide the one that closes the pool."""
        try:
            protocol.send_packet(self.sock, Kill(pid, int(sig)))
        except OSError:
            pass

    def death_message(self) -> str:
        if self.status is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.status = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                pass
        how = ""
        if self.status is not None and self.status < 0:
            how = f" (killed by {signal.Signals(-self.status).name})"
        elif self.status is not None:
            how = f" (exit code {self.status})"
        return (f"the pool's zygote process (pid {self.pid}, which forks the workers) died{how}; its workers "
                "died with it and none can be replaced")

    def shutdown(self, grace: float) -> None:
        """Stop every worker, then the zygote; returns once everything is reaped."""
        if self.status is not None:  # already reaped (death_message)
            self.sock.close()
            return
        try:
            protocol.send_packet(self.sock, Shutdown(grace))
        except OSError:
            pass
        # The zygote closes its end only by exiting, after reaping all workers.
        deadline = time.monotonic() + 2 * grace + 2.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(self.sock, left):
                try:  # stuck: its workers die with it (PDEATHSIG)
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            try:
                msg, fds = protocol.recv_packet(self.sock)
            except (OSError, PoolError):
                msg, fds = None, []
            for fd in fds:
                os.close(fd)
            if msg is None:
                break
        _, status = os.waitpid(self.pid, 0)
        self.status = os.waitstatus_to_exitcode(status)
        self.sock.close()


def _readable(sock, timeout: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(timeout))


class ForkServer:
    """The zygote's event loop: spawn requests, child exits and worker output."""

    def __init__(self, ctl: socket.socket, devices, engine_factory, max_frame: int):
        self.ctl = ctl
        self.devices = devices
        self.engine_factory = engine_factory
        self.max_frame = max_frame
        self.children: dict[int, int] = {}  # pid -> rank
        self.outputs: dict[int, list] = {}  # pipe fd -> [target fd, prefix, partial line]
        self.stop_at: float | None = None  # when a stop began (Shutdown, or the parent's EOF)
        self.grace = 0.0
        self.signalled: set[int] = set()  # escalation steps done: SIGTERM, SIGKILL
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, "ctl")
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # SIGCHLD only writes a byte to this pipe; reaping happens in the loop, so no exit
        # status is ever lost between two select calls.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        self.sel.register(wake_r, selectors.EVENT_READ, "sigchld")
        self.wake_r = wake_r

    def run(self) -> None:
        while not (self.stop_at is not None and not self.children):
            for key, _ in self.sel.select(self.escalate()):
                if key.data == "ctl":
                    self.on_control()
                elif key.data == "sigchld":
                    self.reap()
                else:
                    self.relay(key.fd)
            self.reap()  # cheap; also catches exits whose wakeup byte we already drained
        for fd in list(self.outputs):  # flush what the dead workers printed last
            self.relay(fd, final=True)

    def on_control(self) -> None:
        try:
            msg, _ = protocol.recv_packet(self.ctl)
        except (ConnectionResetError, PoolError):
            msg = None
        if msg is None:  # the parent is gone: stop everything at once
            self.sel.unregister(self.ctl)
            self.begin_stop(grace=0.0)
        elif isinstance(msg, Spawn):
            self.spawn(msg.rank)
        elif isinstance(msg, Kill):
            if msg.pid in self.children:
                os.kill(msg.pid, msg.signal)
        elif isinstance(msg, Shutdown):
            self.begin_stop(msg.grace)

    def begin_stop(self, grace: float) -> None:
        if self.stop_at is None or grace == 0.0:
            self.stop_at, self.grace = time.monotonic(), grace

    def escalate(self) -> float | None:
        """TERM, then KILL, the workers that outlive the grace periods; the time to the next step."""
        if self.stop_at is None:
            return None
        elapsed = time.monotonic() - self.stop_at
        for step, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=1):
            if elapsed >= step * self.grace and sig not in self.signalled:
                self.signalled.add(sig)
                for pid in self.children:
                    os.kill(pid, sig)
            if sig not in self.signalled:
                return step * self.grace - elapsed
        return 0.5  # after SIGKILL only reaping is left

    def report(self, msg, fds=()) -> None:
        try:
            protocol.send_packet(self.ctl, msg, fds)
        except OSError:
            pass  # the parent is gone; we are stopping anyway

    def spawn(self, rank: int) -> None:
        device = self.devices[rank]
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()

        def redirect_output():
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)

        pid = fork_child(lambda: worker_main(theirs, device, self.engine_factory, self.max_frame),
                         keep=(theirs.fileno(),), setup=redirect_output)
        theirs.close()
        os.close(out_w)
        os.close(err_w)
        self.children[pid] = rank
        self.report(Spawned(rank, pid), [ours.fileno()])
        ours.close()  # the parent holds the only copy now: EOF stays meaningful
        prefix = f"[w{rank} {device.name}] ".encode()
        for fd, target in ((out_r, 1), (err_r, 2)):
            self.outputs[fd] = [target, prefix, b""]
            self.sel.register(fd, selectors.EVENT_READ, "output")

    def reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            self.report(Exited(pid, code if code >= 0 else None, -code if code < 0 else None))

    def relay(self, fd: int, final: bool = False) -> None:
        """Copy a worker's output to ours, each complete line prefixed (``final``: all that is left)."""
        if final:
            os.set_blocking(fd, False)
        entry = self.outputs[fd]
        target, prefix = entry[0], entry[1]
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if not data:
                break
            lines = [_last_state(line) for line in (entry[2] + data).split(b"\n")]
            entry[2] = lines.pop()
            _write(target, b"".join(prefix + line + b"\n" for line in lines))
            if not final:
                return
        if data is None and not final:
            return
        if entry[2]:
            _write(target, prefix + entry[2] + b"\n")
        self.sel.unregister(fd)
        os.close(fd)
        del self.outputs[fd]


def _last_state(line: bytes) -> bytes:
    """A line redrawn with carriage returns (a progress bar) as its last state."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def _write(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # nobody reads our stdout any more; never die of it
