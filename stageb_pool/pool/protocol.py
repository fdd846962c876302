"""The wire protocol between the parent, the zygote and the workers: msgspec Structs in one
tagged union, each framed as a 4-byte big-endian length and its JSON, refused above
``max_frame`` on both ends. Who sends what: docs/architecture.md, "Wire protocol".
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Union

import msgspec

from .errors import FrameTooLarge, PoolError, ProtocolError  # noqa: F401 - part of this module's API

PROTOCOL_VERSION = 2  # 2: Cancel
MAX_FRAME_BYTES = 256 * 1024 * 1024  # one result of a big rollout chunk is a few MB
HEADER = struct.Struct("!I")


class Message(msgspec.Struct, tag_field="type", tag=True):
    """Base of all messages; the tag is the class name."""


class Ready(Message):
    version: int
    pid: int
    info: dict[str, Any] = {}


class InitFailed(Message):
    version: int
    pid: int
    error: str
    traceback: str


class Share(Message):
    """A shared value the worker caches under ``key`` (its content hash), after dropping the
    ``evict`` keys, so its cache mirrors the parent's bookkeeping."""

    key: str
    value: msgspec.Raw  # decoded by the worker into the type the engine method declares
    evict: list[str] = []


class Task(Message):
    """Run ``engine.<method>(item, **{name: cache[key] for name, key in shared.items()})``."""

    id: int
    method: str
    item: msgspec.Raw  # decoded by the worker into the type the engine method declares
    shared: dict[str, str] = {}


class Result(Message):
    id: int
    value: msgspec.Raw  # decoded by the parent, with the caller's result_type when given


class Failure(Message):
    id: int
    error: str
    traceback: str


class Cancel(Message):
    """To a forked worker running task ``id``: its result is no longer wanted. An engine that
    can stop early raises ``TaskCancelled`` at its next checkpoint (``cancellation.py``); a
    Cancel that finds the task finished is dropped."""

    id: int


class Shutdown(Message):
    """To a worker: finish and exit. To the zygote: stop all workers (message, TERM, KILL)."""

    grace: float = 1.0


class Spawn(Message):
    rank: int


class Spawned(Message):
    rank: int
    pid: int


class Kill(Message):
    pid: int
    signal: int


class Exited(Message):
    pid: int
    exitcode: int | None  # None when killed by a signal
    signal: int | None


AnyMessage = Union[Ready, InitFailed, Share, Task, Cancel, Result, Failure, Shutdown, Spawn, Spawned, Kill, Exited]
Request = Union[Share, Task, Cancel, Shutdown]  # parent -> worker (worker_core.py)
Reply = Union[Ready, InitFailed, Result, Failure]  # worker -> parent (dispatch.py)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyMessage)
_requests = msgspec.json.Decoder(Request)
_replies = msgspec.json.Decoder(Reply)


def encode(value) -> bytes:
    return _encoder.encode(value)


def frame(msg: Message, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: length prefix + JSON. Raises FrameTooLarge before anything is sent."""
    body = _encoder.encode(msg)
    if len(body) > max_frame:
        raise FrameTooLarge(len(body), max_frame, f"{type(msg).__name__} frame")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"cannot decode message ({exc}): {bytes(body[:120])!r}") from None


def decode_request(body: bytes) -> Request:
    return _decode_as(_requests, body, "worker")


def decode_reply(body: bytes) -> Reply:
    return _decode_as(_replies, body, "parent")


def _decode_as(decoder: msgspec.json.Decoder, body: bytes, receiver: str):
    """One message of ``decoder``'s union; any other is a ProtocolError naming what came."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError:
        unexpected = decode(body)  # itself a ProtocolError when it is no message at all
        raise ProtocolError(f"{receiver} got unexpected {type(unexpected).__name__}") from None


def _check_incoming(size: int, max_frame: int) -> None:
    # Refuse an oversize length before reading the body: never a silent desynchronisation.
    if size > max_frame:
        raise ProtocolError(f"incoming frame of {size:,} bytes exceeds the limit of {max_frame:,} bytes")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_body(sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> bytes | None:
    """Receive one frame's body, undecoded (blocking, for the worker side); None on EOF."""
    header = _recv_exact(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    _check_incoming(size, max_frame)
    return _recv_exact(sock, size)


class FrameReader:
    """Incremental frame parser: a worker that stalls mid-frame never blocks the parent."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        self.max_frame = max_frame
        self.buffer = bytearray()  # the start of a frame not yet complete

    def needed(self) -> int:
        """The bytes that would complete the frame being read (its header first)."""
        have = len(self.buffer)
        if have < HEADER.size:
            return HEADER.size - have
        (size,) = HEADER.unpack_from(self.buffer)
        return max(HEADER.size + size - have, 0)

    def feed(self, data: bytes) -> list[Reply]:
        """The replies in the frames that ``data`` completes (the parent's side)."""
        return [decode_reply(body) for body in self.bodies(data)]

    def bodies(self, data: bytes) -> list:
        """The bodies of the frames ``data`` completes, undecoded; views of ``data`` (no copy)
        when no partial frame was waiting."""
        if self.buffer:
            self.buffer += data
            if self.needed():  # still incomplete: parse it once it is whole, not at every read
                return []
            data, self.buffer = bytes(self.buffer), bytearray()
        elif len(data) >= HEADER.size and HEADER.unpack_from(data)[0] == len(data) - HEADER.size:
            _check_incoming(len(data) - HEADER.size, self.max_frame)  # exactly one frame: most reads
            return [memoryview(data)[HEADER.size:]]
        view, bodies, start = memoryview(data), [], 0
        while len(data) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(data, start)
            _check_incoming(size, self.max_frame)
            end = start + HEADER.size + size
            if end > len(data):
                break
            bodies.append(view[start + HEADER.size:end])
            start = end
        self.buffer += view[start:]
        return bodies


# The zygote channel is a SOCK_SEQPACKET socketpair: one frame per packet, so a file
# descriptor passed with SCM_RIGHTS arrives together with the message that explains it.
PACKET_MAX = 64 * 1024


def send_packet(sock: socket.socket, msg: Message, fds: list[int] = ()) -> None:
    data = frame(msg, PACKET_MAX)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_packet(sock: socket.socket) -> tuple[Message | None, list[int]]:
    """One packet from the zygote channel: (message, passed fds); (None, []) on EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, PACKET_MAX + HEADER.size, 4)
    if not data:
        return None, list(fds)
    (size,) = HEADER.unpack_from(data)
    if size != len(data) - HEADER.size:
        raise ProtocolError(f"zygote packet of {len(data)} bytes announces {size} bytes")
    return decode(data[HEADER.size:]), list(fds)
