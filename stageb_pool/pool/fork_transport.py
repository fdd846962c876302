"""The fork backend's transport: workers forked by the zygote, one socketpair each. ``poll``
is one ``select`` over every worker socket and the zygote's control socket; frames are parsed
incrementally, so a worker that stalls mid-frame never blocks the parent.
"""

from __future__ import annotations

import selectors
import signal
import socket

from . import protocol
from .dispatch import WorkerClosed, WorkerExited, WorkerMessage, WorkerStarted
from .errors import PoolError, ProtocolError
from .protocol import Cancel, Exited, Shutdown, Spawned
from .tasks import PoolStats
from .zygote import Zygote

CLOSE_GRACE = 1.0  # seconds a worker gets after Shutdown, and again after SIGTERM, before SIGKILL
# One read asks for the rest of the frame, within these bounds (a read allocates its size:
# 1 MiB per read cost 16.7 us against 2.4 for 64 KiB).
RECV_MIN = 64 * 1024
RECV_MAX = 16 * 1024 * 1024


class ForkedTransport:
    """Forks the zygote at once (so create it first thing), then workers on request."""

    def __init__(self, devices, engine_factory, max_frame: int, stats: PoolStats):
        self.devices = devices
        self.max_frame = max_frame
        self.stats = stats
        self.zygote = Zygote(devices, engine_factory, max_frame)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.zygote.sock, selectors.EVENT_READ, None)
        self.socks: dict[int, socket.socket] = {}  # rank -> socket of its current worker
        self.readers: dict[int, protocol.FrameReader] = {}
        self.pid_of: dict[int, int] = {}  # rank -> pid of its current worker
        self.events: list = []  # found outside poll (a send to a worker that is gone)

    def spawn(self, rank: int) -> None:
        self.zygote.spawn(rank)

    def send(self, rank: int, data: bytes) -> None:
        sock = self.socks.get(rank)
        if sock is None:
            return
        try:
            sock.sendall(data)
        except OSError:  # it died; its exit report will follow
            self._drop(rank)
            self.events.append(WorkerClosed(rank))
            return
        self.stats.bytes_sent += len(data)

    def cancel(self, rank: int, task_id: int) -> None:
        self.send(rank, protocol.frame(Cancel(task_id)))

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        if rank in self.pid_of:
            self.zygote.kill(self.pid_of[rank], sig)

    def poll(self, timeout: float | None) -> list:
        events, self.events = self.events, []
        for key, _ in self.sel.select(0.0 if events else timeout):
            if key.data is None:
                self._on_zygote(events)
            elif self.socks.get(key.data) is key.fileobj:  # not dropped by an earlier event
                self._read(key.data, events)
        return events

    def close(self, busy: list[int]) -> None:
        for rank in list(self.socks):
            if rank in busy:
                # Mid-task it cannot read Shutdown: stop it now (Ctrl-C stays prompt).
                self.kill(rank, signal.SIGTERM)
            else:
                try:
                    self.socks[rank].sendall(protocol.frame(Shutdown()))
                except OSError:
                    pass
            self._drop(rank)
        self.zygote.shutdown(CLOSE_GRACE)  # returns once all workers and the zygote are reaped
        self.sel.close()

    def _read(self, rank: int, events: list, *, final: bool = False) -> None:
        try:
            reader = self.readers[rank]
            data = self.socks[rank].recv(min(max(reader.needed(), RECV_MIN), RECV_MAX) if reader.buffer else RECV_MIN)
        except OSError:
            data = b""
        if not data:
            self._drop(rank)
            if not final:
                events.append(WorkerClosed(rank))
            return
        self.stats.bytes_received += len(data)
        try:
            messages = reader.feed(data)
        except ProtocolError as exc:
            self.kill(rank)
            raise ProtocolError(f"worker {rank} ({self.devices[rank].name}): {exc}") from None
        events.extend(WorkerMessage(rank, msg) for msg in messages)

    def _on_zygote(self, events: list) -> None:
        msg, fds = protocol.recv_packet(self.zygote.sock)
        if msg is None:
            raise PoolError(self.zygote.death_message())
        if isinstance(msg, Spawned):
            sock = socket.socket(fileno=fds[0])
            self.socks[msg.rank], self.pid_of[msg.rank] = sock, msg.pid
            self.readers[msg.rank] = protocol.FrameReader(self.max_frame)
            self.sel.register(sock, selectors.EVENT_READ, msg.rank)
            events.append(WorkerStarted(msg.rank, msg.pid))
        elif isinstance(msg, Exited):
            rank = next((r for r, pid in self.pid_of.items() if pid == msg.pid), None)
            if rank is None:
                return
            del self.pid_of[rank]
            if rank in self.socks:  # read what it wrote before dying (a result, maybe)
                self.socks[rank].setblocking(False)
                while rank in self.socks:
                    self._read(rank, events, final=True)
            events.append(WorkerExited(rank, msg.exitcode, msg.signal))

    def _drop(self, rank: int) -> None:
        sock = self.socks.pop(rank, None)
        if sock is not None:
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
