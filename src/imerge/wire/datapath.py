"""The data channel's frames: bulk bytes beside gRPC, read straight into their place. Pure: no grpc, no redis.

A frame is a fixed 20-byte header, a protobuf meta and a raw payload::

    magic "IMdc" | kind u8 | flags u8 | reserved u16 (0) | meta length u32 | payload length u64

all little-endian. The meta is the message of the frame's kind (a
``PushHeader`` for a push, a ``PullRequest``, a ``TensorMeta`` before a pulled
block's data, ...: the messages of ``proto/``, so that one contract describes
both data paths); the payload is the tensor's bytes as the block's encoding
makes them (see :mod:`imerge.core.compression`), which the receiver reads with
``recv_into`` straight into the gradient row or the parameters. A reader checks
the header (magic, kind, lengths within their bounds) and parses the meta before
it reads a byte of the payload; whoever applies the frame checks the payload's
length against the block before reading it.

A connection carries one call at a time (a push of some blocks, or a pull):
the worker keeps a pool of them per shard, so that calls never queue behind
each other on one stream. The first frame of a connection is a HELLO carrying
the (worker, generation) token that the shard's ``OpenChannel`` handed out.

Anything that moves bytes through :class:`Conn` (a socket, a TLS socket) can
carry the frames: an RDMA or shared-memory transport would implement the same
two methods.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from imerge.core.errors import InvalidArgument, RequestError, request_error_classes
from imerge.core.native import RECV_CLOSED, RECV_TIMEOUT, data_plane
from imerge.wire.channel import MAX_MESSAGE_BYTES

MAGIC = b"IMdc"
HEADER = struct.Struct("<4sBBHIQ")
MAX_META_BYTES = MAX_MESSAGE_BYTES  # what one gRPC message may hold: a push header, a pull of many blocks
TOKEN_BYTES = 16
READ_CHUNK_BYTES = 64 << 10  # a meta or a dropped payload is read in pieces this large: memory grows as bytes come
SMALL_META_BYTES = 4096  # a meta this small is read with its frame's header, where it came with it (read_head)
META_LENGTH_AT = 8  # the offset of the meta's length in the header
MAX_GATHERED = 64  # the most buffers the data plane writes in one call (a frame's header and payload parts)
NATIVE_READ_BYTES = 64 << 10  # a read this large goes through the data plane's receive loop (see read_exact)
_ERRORS = request_error_classes()
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)  # Linux: a socket's memory counters (struct sk_meminfo)
MEMINFO = struct.Struct("=9I")
WMEM_ALLOC = 2  # SK_MEMINFO_WMEM_ALLOC: the bytes of its packets below TCP that have not left the host yet


class Kind(enum.IntEnum):
    HELLO = 1    # worker -> shard, first frame: ChannelHello
    WELCOME = 2  # shard -> worker: the hello was accepted (no meta)
    PUSH = 3     # worker -> shard: PushHeader, then the gradient's payload
    RESULT = 4   # shard -> worker: BlockPushResult of one PUSH
    PULL = 5     # worker -> shard: PullRequest
    BLOCK = 6    # shard -> worker: TensorMeta, then the block's payload (one per block pulled)
    END = 7      # shard -> worker: a pull's blocks are all sent
    ERROR = 8    # shard -> worker: ChannelError; the shard closes the connection after it


CARRIES_PAYLOAD = frozenset({Kind.PUSH, Kind.BLOCK})
# The largest meta of each kind: a HELLO (a token and two integers) or a result is tiny, and a client that has
# not yet shown its token can make the shard hold no more than that; a push header (hyperparameters, a mask of
# segments) or a pull of many blocks may be as large as a gRPC message.
MAX_META = {Kind.HELLO: 256, Kind.WELCOME: 0, Kind.PUSH: MAX_META_BYTES, Kind.RESULT: 4096, Kind.PULL: MAX_META_BYTES,
            Kind.BLOCK: 4096, Kind.END: 0, Kind.ERROR: 1 << 20}


class Conn(Protocol):
    """What carries frames: a connected socket (or a TLS socket)."""

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int: ...

    def sendall(self, data: Any) -> None: ...

    def sendmsg(self, buffers: Sequence[Any]) -> int: ...


class ChannelClosed(ConnectionError):
    """The peer closed the connection (at a frame's boundary: ``clean``; else in the middle of one)."""

    def __init__(self, message: str, clean: bool = False):
        super().__init__(message)
        self.clean = clean


def read_exact(conn: Conn, view: memoryview, what: str) -> None:
    """Fill ``view`` from ``conn`` (no copy: the bytes land in ``view``'s memory). A large read from a plain
    socket runs in the data plane's receive loop (native where built: one call, the GIL released throughout)."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    received, size = 0, len(view)
    if size >= NATIVE_READ_BYTES and type(conn) is socket.socket:
        plane = data_plane()
        while received < size:
            count, _, state = plane.recv_into(conn, view, received, False, budget_s=None)  # till the timeout
            received += count
            if state == RECV_CLOSED:
                raise ChannelClosed(f"{what}: the connection closed after {received} of {size} bytes")
            if state == RECV_TIMEOUT:
                raise TimeoutError(f"{what}: nothing for {conn.gettimeout()}s after {received} of {size} bytes")
        return
    while received < size:
        count = conn.recv_into(view[received:], size - received)
        if count == 0:
            raise ChannelClosed(f"{what}: the connection closed after {received} of {size} bytes")
        received += count


def skip(conn: Conn, nbytes: int, what: str, chunk_bytes: int = READ_CHUNK_BYTES) -> None:
    """Read and drop ``nbytes`` (a payload that is not applied: a duplicate)."""
    scratch = memoryview(bytearray(min(nbytes, chunk_bytes)))
    while nbytes > 0:
        count = min(nbytes, len(scratch))
        read_exact(conn, scratch[:count], what)
        nbytes -= count


class FrameHeader:
    """A frame's header, checked: known kind, lengths within their bounds."""

    __slots__ = ("kind", "flags", "meta_len", "payload_len")

    def __init__(self, kind: Kind, meta_len: int, payload_len: int, flags: int = 0):
        self.kind, self.meta_len, self.payload_len, self.flags = kind, meta_len, payload_len, flags

    def encode(self) -> bytes:
        return HEADER.pack(MAGIC, self.kind, self.flags, 0, self.meta_len, self.payload_len)

    @classmethod
    def decode(cls, raw: bytes | bytearray | memoryview, max_payload: int) -> "FrameHeader":
        magic, kind, flags, reserved, meta_len, payload_len = HEADER.unpack(raw)
        if magic != MAGIC or reserved:
            raise InvalidArgument(f"data channel: not a frame (header {bytes(raw[:8]).hex()}...): the peer does not "
                                  "speak IMerge's data channel")
        try:
            kind = Kind(kind)
        except ValueError:
            raise InvalidArgument(f"data channel: unknown frame kind {kind}") from None
        if meta_len > MAX_META[kind]:
            raise InvalidArgument(f"data channel: {kind.name} frame's meta of {meta_len} bytes is more than "
                                  f"the {MAX_META[kind]} a {kind.name} frame may carry")
        if kind not in CARRIES_PAYLOAD and payload_len:
            raise InvalidArgument(f"data channel: a {kind.name} frame carries no payload, this one declares "
                                  f"{payload_len} bytes")
        if payload_len > max_payload:
            raise InvalidArgument(f"data channel: {kind.name} frame declares {payload_len} bytes of payload, more "
                                  f"than the {max_payload} of the largest block")
        return cls(kind, meta_len, payload_len, flags)


def read_header(conn: Conn, max_payload: int, what: str) -> FrameHeader:
    """The next frame's header; :class:`ChannelClosed` (``clean``) when the peer closed between frames."""
    raw = bytearray(HEADER.size)
    view = memoryview(raw)
    first = conn.recv_into(view, HEADER.size)
    if first == 0:
        raise ChannelClosed(f"{what}: the connection closed", clean=True)
    if first < HEADER.size:
        read_exact(conn, view[first:], what)
    return FrameHeader.decode(raw, max_payload)


def plain_socket(conn: Any) -> socket.socket | None:
    """The plain socket ``conn`` is, or carries its frames on unchanged (a stream's ``plain``); None for a TLS
    socket, whose bytes pass its own methods."""
    return conn if type(conn) is socket.socket else getattr(conn, "plain", None)


def host_queued_bytes(sock: socket.socket) -> int:
    """The bytes ``sock`` has handed below TCP that have not left this host yet: in its queueing discipline
    and the device's queue, where they wait for the host's uplink (Linux's SK_MEMINFO_WMEM_ALLOC, packet
    overhead included). Bytes TCP still holds (its window is full: the path beyond is slower) do not count.
    0 where the system does not tell; OSError once the socket is closed."""
    if not sys.platform.startswith("linux"):
        return 0
    return int(MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, MEMINFO.size))[WMEM_ALLOC])


def read_head(conn: Conn, max_payload: int, what: str) -> tuple[FrameHeader, bytes]:
    """As :func:`read_header`, and the bytes of the frame's meta that came with the header (:func:`read_meta`
    reads the rest). From a plain socket the data plane reads both in one call, the GIL released once."""
    plain = plain_socket(conn)
    head = data_plane().recv_head(plain, HEADER.size, META_LENGTH_AT, SMALL_META_BYTES) if plain else None
    if plain is None or head is None:
        return read_header(conn, max_payload, what), b""
    state, data = head
    if state == RECV_TIMEOUT:
        raise TimeoutError(f"{what}: nothing for {plain.gettimeout()}s")
    if state == RECV_CLOSED:
        if not data:
            raise ChannelClosed(f"{what}: the connection closed", clean=True)
        raise ChannelClosed(f"{what}: the connection closed after {len(data)} of {HEADER.size} bytes")
    return FrameHeader.decode(data[:HEADER.size], max_payload), data[HEADER.size:]


def read_meta(conn: Conn, header: FrameHeader, message_type: Any, what: str, received: bytes = b"") -> Any:
    """The frame's meta, parsed as ``message_type`` (InvalidArgument if it is not one); ``received``: its first
    bytes, read with the header. The buffer grows as the bytes arrive: a peer that declares a large meta and
    sends little makes the reader hold little."""
    raw = bytearray(received)
    while len(raw) < header.meta_len:
        piece = bytearray(min(header.meta_len - len(raw), READ_CHUNK_BYTES))
        read_exact(conn, memoryview(piece), what)
        raw += piece
    message = message_type()
    try:
        message.ParseFromString(bytes(raw))
    except Exception as exc:  # protobuf's DecodeError, or a RuntimeWarning-free failure of a nested message
        raise InvalidArgument(f"{what}: the {header.kind.name} frame's meta is not a valid "
                              f"{message_type.DESCRIPTOR.full_name}: {exc}") from None
    return message


def expect(header: FrameHeader, *kinds: Kind, what: str) -> None:
    if header.kind not in kinds:
        raise InvalidArgument(f"{what}: a {header.kind.name} frame where {' or '.join(k.name for k in kinds)} "
                              "was due")


def send_frame(conn: Conn, kind: Kind, meta: Any = None, parts: Sequence[Any] = (), flags: int = 0) -> None:
    """One frame: the header, the meta and each payload part, written from their own memory in gathered writes
    (the header goes out in the payload's first segment: the peer wakes once for both); on a plain socket by
    the data plane, the GIL released throughout, else one write each (TLS)."""
    encoded = meta.SerializeToString() if meta is not None else b""
    views = [memoryview(part).cast("B") for part in parts]
    payload_len = sum(len(view) for view in views)
    head = FrameHeader(kind, len(encoded), payload_len, flags).encode() + encoded
    buffers = [memoryview(head), *views]
    plain = plain_socket(conn)
    if plain is not None and len(buffers) <= MAX_GATHERED and data_plane().send_parts(plain, buffers) is not None:
        return
    if not payload_len:
        conn.sendall(head)
        return
    try:
        sent = conn.sendmsg(buffers)
    except NotImplementedError:  # a TLS socket: a small frame in one record, a large one a buffer at a time
        if payload_len <= 64 << 10:
            conn.sendall(head + b"".join(views))
            return
        sent = 0
    for buffer in buffers:  # the rest, where the kernel took only part of them (its send buffer filled up)
        if sent >= len(buffer):
            sent -= len(buffer)
        else:
            conn.sendall(buffer[sent:])
            sent = 0


def channel_token(secret: bytes, worker: int, generation: int) -> bytes:
    """The token a worker's connection must carry in ``generation``: bound to both, unforgeable without the
    shard's secret."""
    return hmac.new(secret, f"{worker}:{generation}".encode(), hashlib.sha256).digest()[:TOKEN_BYTES]


def error_meta(exc: RequestError, message_type: Any) -> Any:
    return message_type(error=type(exc).__name__, message=str(exc))


def error_from_meta(meta: Any, address: str) -> RequestError:
    """The error an ERROR frame stands for, as the class the shard raised."""
    cls = _ERRORS.get(meta.error, RequestError)
    return cls(meta.message or meta.error, address=address)
