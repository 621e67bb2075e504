"""The data channel's frame I/O on real sockets: a frame written in one gathered write, its header and meta read
in one call of the data plane (the Python plane's reads where the extension is not built, or the socket is TLS),
and every way a peer can stop short."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from imerge.core import native
from imerge.core.native import RECV_CLOSED, RECV_DONE, RECV_TIMEOUT
from imerge.wire import datapath
from imerge.wire.datapath import (HEADER, META_LENGTH_AT, SMALL_META_BYTES, ChannelClosed, FrameHeader, Kind,
                                  read_exact, read_head, read_meta, send_frame)
from imerge.wire.rpc import ps_pb2

PLANES = ["native", "python"]


@pytest.fixture(params=PLANES)
def plane(request, monkeypatch):
    """Frame I/O on the data plane named: the extension, or Python's (as where it cannot be built)."""
    if request.param == "native" and not native.native_available():
        pytest.skip(native.why_unavailable())
    chosen = native.data_plane(request.param)
    monkeypatch.setattr(datapath, "data_plane", lambda choice="auto": chosen)
    return request.param


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    right.settimeout(5)
    with left, right:
        yield left, right


def encoded(kind: Kind, meta, payload: bytes = b"") -> bytes:
    raw = meta.SerializeToString()
    return FrameHeader(kind, len(raw), len(payload)).encode() + raw + payload


def later(action, pause_s: float = 0.1) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(pause_s), action()), daemon=True)
    thread.start()
    return thread


def test_a_frame_written_in_one_write_is_read_whole(plane, pair):
    left, right = pair
    meta = ps_pb2.PushHeader(block_id="b0", worker=1, round=7, numel=3 << 20)
    payload = bytes(range(256)) * (3 << 14)  # 12 MiB: more than a socket buffer holds, so the write goes on
    writer = threading.Thread(target=send_frame, args=(left, Kind.PUSH, meta, [payload[:5], payload[5:]]))
    writer.start()
    header, received = read_head(right, 1 << 30, "test")
    assert (header.kind, header.meta_len, header.payload_len) == (Kind.PUSH, meta.ByteSize(), len(payload))
    assert read_meta(right, header, ps_pb2.PushHeader, "test", received) == meta
    target = memoryview(bytearray(len(payload)))
    read_exact(right, target, "test")
    writer.join(10)
    assert bytes(target) == payload


def test_a_meta_that_comes_in_pieces_is_read_on_from_what_came_with_the_header(plane, pair):
    """The head's call never waits for the meta (the header is checked first): what came with it is handed
    on, and the rest read as it comes."""
    left, right = pair
    frame = encoded(Kind.PULL, ps_pb2.PullRequest(block_ids=[f"block-{i}" for i in range(40)], worker=3))
    left.sendall(frame[:HEADER.size + 10])
    header, received = read_head(right, 0, "test")
    assert header.kind == Kind.PULL and len(received) <= 10
    later(lambda: left.sendall(frame[HEADER.size + 10:]))
    assert read_meta(right, header, ps_pb2.PullRequest, "test", received).worker == 3


def test_a_bad_header_is_refused_without_waiting_for_its_meta(plane, pair):
    left, right = pair
    left.sendall(b"GET / HTTP/1.1\r\n\r\n\x00\x00")  # 20 bytes that declare a meta that never comes
    started = time.monotonic()
    with pytest.raises(Exception, match="not a frame"):
        read_head(right, 0, "test")
    assert time.monotonic() - started < 1.0


def test_a_large_meta_is_left_to_read_meta(plane, pair):
    left, right = pair
    error = ps_pb2.ChannelError(error="Internal", message="x" * (2 * SMALL_META_BYTES))
    left.sendall(encoded(Kind.ERROR, error))
    header, received = read_head(right, 0, "test")
    assert received == b"" and header.meta_len > SMALL_META_BYTES
    assert read_meta(right, header, ps_pb2.ChannelError, "test", received) == error


def test_a_peer_that_closes_between_frames_is_a_clean_end(plane, pair):
    left, right = pair
    left.close()
    with pytest.raises(ChannelClosed) as closed:
        read_head(right, 0, "test")
    assert closed.value.clean


def test_a_peer_that_closes_inside_a_header_is_not(plane, pair):
    left, right = pair
    left.sendall(encoded(Kind.END, ps_pb2.ChannelError())[:7])
    left.close()
    with pytest.raises(ChannelClosed, match="the connection closed after") as closed:
        read_head(right, 0, "test")
    assert not closed.value.clean


def test_a_silent_peer_times_out_at_the_sockets_timeout(plane, pair):
    _, right = pair
    right.settimeout(0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        read_head(right, 0, "test")
    assert 0.25 < time.monotonic() - started < 3.0


def test_a_payload_from_a_silent_peer_times_out_at_the_sockets_timeout(plane, pair):
    left, right = pair
    left.sendall(b"\x01" * 1000)  # some of it, then nothing
    right.settimeout(0.6)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        read_exact(right, memoryview(bytearray(200_000)), "test")
    assert 0.5 < time.monotonic() - started < 3.0


def test_a_payload_cut_short_says_how_much_came(plane, pair):
    left, right = pair
    left.sendall(b"\x01" * 100_000)
    left.close()
    with pytest.raises(ChannelClosed, match="after 100000 of 200000 bytes"):
        read_exact(right, memoryview(bytearray(200_000)), "test")


def test_the_native_head_call_checks_its_arguments_and_reports_each_state():
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    from imerge.core import _native  # type: ignore[attr-defined]

    with pytest.raises(ValueError, match="outside the head"):
        _native.recv_head(0, HEADER.size, HEADER.size - 2, 16, 100)
    left, right = socket.socketpair()
    with left, right:
        right.setblocking(False)
        frame = encoded(Kind.RESULT, ps_pb2.BlockPushResult(block_id="b", pushed=2))
        left.sendall(frame)
        assert _native.recv_head(right.fileno(), HEADER.size, META_LENGTH_AT, 64, 1000) == (RECV_DONE, frame)
        assert _native.recv_head(right.fileno(), HEADER.size, META_LENGTH_AT, 64, 100) == (RECV_TIMEOUT, b"")
        left.sendall(frame[:5])
        left.close()
        assert _native.recv_head(right.fileno(), HEADER.size, META_LENGTH_AT, 64, 1000) == (RECV_CLOSED, frame[:5])


def test_a_tls_like_socket_is_written_a_buffer_at_a_time(pair):
    """A socket that cannot gather (as ssl.SSLSocket: sendmsg raises NotImplementedError) gets the same
    bytes through sendall."""
    left, right = pair

    class NoGather(socket.socket):
        def sendmsg(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            raise NotImplementedError("sendmsg not allowed on instances of NoGather")

    wrapped = NoGather(left.family, left.type, fileno=left.detach())
    meta = ps_pb2.PushHeader(block_id="b1")
    with wrapped:
        for payload in (b"\x02" * 100, b"\x03" * (200 << 10)):
            writer = later(lambda: send_frame(wrapped, Kind.PUSH, meta, [payload]), 0.0)
            header, received = read_head(right, 1 << 30, "test")
            assert read_meta(right, header, ps_pb2.PushHeader, "test", received) == meta
            target = memoryview(bytearray(header.payload_len))
            read_exact(right, target, "test")
            writer.join(10)
            assert bytes(target) == payload


def test_a_peer_that_stops_reading_times_the_write_out_within_the_sockets_timeout(plane, pair):
    left, right = pair
    left.settimeout(0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        send_frame(left, Kind.BLOCK, ps_pb2.TensorMeta(block_id="b"), [bytes(64 << 20)])  # never read
    assert 0.4 < time.monotonic() - started < 5.0


def test_a_write_to_a_peer_gone_fails_as_the_sockets_would(plane, pair):
    left, right = pair
    right.close()
    left.settimeout(5)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        send_frame(left, Kind.BLOCK, ps_pb2.TensorMeta(block_id="b"), [bytes(1 << 20)])


def test_the_native_write_checks_its_parts():
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    from imerge.core import _native  # type: ignore[attr-defined]

    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(ValueError, match="more than 64 parts"):
            _native.send_parts(left.fileno(), [b"x"] * 65, 100)
        with pytest.raises(TypeError):
            _native.send_parts(left.fileno(), [b"x", 3], 100)
        assert _native.send_parts(left.fileno(), [b"ab", b"", bytearray(b"cd")], 100) == (4, RECV_DONE)
        assert right.recv(10) == b"abcd"
