"""Wire protocol: framing, size limits, the tagged union, fd passing."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest

from stageb_pool.pool import protocol
from stageb_pool.pool.protocol import (
    Exited, Failure, FrameReader, FrameTooLarge, InitFailed, Kill, ProtocolError, Ready, Result,
    Shutdown, Share, Spawn, Spawned, Task,
)

MESSAGES = [
    Ready(1, 123, {"torch": "2.13"}),
    InitFailed(1, 123, "RuntimeError: x", "Traceback ..."),
    Share("abcd", msgspec.Raw(b'{"G0":"rule"}'), evict=["old"]),
    Task(7, "rollout", msgspec.Raw(b'{"tickets":[1,2]}'), {"guidance": "abcd"}),
    Failure(7, "ValueError: bad", "Traceback ..."),
    Shutdown(2.0),
    Spawn(3),
    Spawned(3, 456),
    Kill(456, 9),
    Exited(456, None, 9),
    Exited(457, 0, None),
]
REPLIES = (Ready, InitFailed, Result, Failure)


def messages(reader: FrameReader, data: bytes) -> list:
    """Every message in the frames ``data`` completes, whoever it is for."""
    return [protocol.decode(body) for body in reader.bodies(data)]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_with_its_type_tag(msg):
    data = protocol.frame(msg)
    (size,) = protocol.HEADER.unpack(data[:4])
    assert size == len(data) - 4
    assert msgspec.json.decode(data[4:])["type"] == type(msg).__name__
    assert messages(FrameReader(), data) == [msg]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_the_parent_reads_replies_only_and_names_anything_else(msg):
    data = protocol.frame(msg)
    if isinstance(msg, REPLIES):
        assert FrameReader().feed(data) == [msg]
    else:
        with pytest.raises(ProtocolError, match=f"^parent got unexpected {type(msg).__name__}$"):
            FrameReader().feed(data)


def test_task_items_and_shared_values_stay_raw_until_the_worker_decodes_them():
    task, share = messages(FrameReader(), protocol.frame(MESSAGES[3]) + protocol.frame(MESSAGES[2]))
    assert isinstance(task.item, msgspec.Raw) and bytes(task.item) == b'{"tickets":[1,2]}'
    assert isinstance(share.value, msgspec.Raw) and bytes(share.value) == b'{"G0":"rule"}'


def test_result_value_stays_raw_until_the_parent_decodes_it():
    (got,) = FrameReader().feed(protocol.frame(Result(1, {"a": [1, 2.5, None]})))
    assert isinstance(got.value, msgspec.Raw)
    assert msgspec.json.decode(got.value) == {"a": [1, 2.5, None]}


def test_reader_says_how_many_bytes_complete_the_frame_it_reads():
    """The parent asks a socket for this much (at least 64 KiB): never 1 MiB per small result,
    and a big frame in few reads."""
    data = protocol.frame(Result(1, "x" * 100_000))
    reader = FrameReader()
    assert reader.needed() == 4  # the header first
    assert reader.feed(data[:2]) == []
    assert reader.needed() == 2
    assert reader.feed(data[2:10]) == []
    assert reader.needed() == len(data) - 10  # the rest of this frame, whatever was announced
    assert reader.feed(data[10:] + data[:3]) == [Result(1, msgspec.Raw(protocol.encode("x" * 100_000)))]
    assert reader.needed() == 1  # the next frame's header


def test_reader_reassembles_frames_fed_byte_by_byte():
    data = b"".join(protocol.frame(m) for m in MESSAGES)
    reader, got = FrameReader(), []
    for i in range(len(data)):
        got += messages(reader, data[i:i + 1])
    assert got == MESSAGES and not reader.buffer


def test_an_oversize_frame_names_the_size_before_anything_is_sent():
    with pytest.raises(FrameTooLarge, match=r"Task frame of 1,0\d\d bytes exceeds the pool's frame limit of 1,000 bytes"):
        protocol.frame(Task(1, "m", msgspec.Raw(b'"' + b"x" * 1000 + b'"')), max_frame=1000)


def test_oversize_header_on_receive_is_a_protocol_error():
    header = protocol.HEADER.pack(5000)
    with pytest.raises(ProtocolError, match="5,000 bytes exceeds the limit of 1,000"):
        FrameReader(max_frame=1000).feed(header)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(header + b"{}")
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            protocol.recv_body(b, max_frame=1000)


@pytest.mark.parametrize("body", [b"not json", b'{"type": "Nope"}', b'{"type": "Task", "id": "x"}', b"[]"])
def test_garbage_is_a_protocol_error(body):
    with pytest.raises(ProtocolError, match="cannot decode message"):
        messages(FrameReader(), protocol.HEADER.pack(len(body)) + body)


def test_blocking_recv_reads_frames_and_reports_eof():
    a, b = socket.socketpair()
    with b:
        a.sendall(protocol.frame(Spawn(1)))
        a.sendall(protocol.frame(Spawn(2))[:5])  # a torn frame, then EOF
        a.close()
        assert protocol.decode(protocol.recv_body(b)) == Spawn(1)
        assert protocol.recv_body(b) is None


def test_packets_carry_file_descriptors():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    with a, b:
        protocol.send_packet(a, Spawned(0, 42), [w])
        protocol.send_packet(a, Exited(42, 1, None))
        msg, fds = protocol.recv_packet(b)
        assert msg == Spawned(0, 42) and len(fds) == 1
        os.write(fds[0], b"hi")
        assert os.read(r, 2) == b"hi"
        assert protocol.recv_packet(b) == (Exited(42, 1, None), [])
        a.close()
        assert protocol.recv_packet(b) == (None, [])
    for fd in (r, w, *fds):
        os.close(fd)
