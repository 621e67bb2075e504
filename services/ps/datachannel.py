"""The shard's data channel: pushes and pulls as frames (:mod:`imerge.wire.datapath`) on TCP connections.

A thread per connection reads its frames; a push's payload is read by the
data plane (:mod:`imerge.core.native`: the C extension, or ``recv_into``)
straight into the worker's gradient row (or a compressed payload's buffer),
checked for NaN and infinity as it lands, with the GIL released, so
connections receive in parallel.
What a frame asks of the shard runs on the shard's event loop as the gRPC
path's calls do (:meth:`Shard.push_header`, :meth:`Shard.pull_blocks`), with
every check made before the payload is read: the connection hands its socket
to that coroutine for the payload (:class:`Handoff`).

A connection must open with a HELLO carrying the token of (worker,
generation) that ``OpenChannel`` handed out, within ``--stream-idle-s``; a
connection silent for that long, between frames or within one, is closed
(within a push: DEADLINE_EXCEEDED, and its row is freed). A refused frame gets
an ERROR frame naming the error's class, and the connection is closed after
the shard read (and dropped) what the worker had already written of its call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch

from imerge.core.codec import tensor_view
from imerge.core.handover import hand_over
from imerge.core.blockround import Aggregate
from imerge.core.native import RECV_CLOSED, RECV_TIMEOUT, DataPlane, data_plane
from imerge.core.rounds import Push
from imerge.core.errors import (Busy, DeadlineExceeded, Internal, InvalidArgument, PermissionDenied, RequestError,
                                Superseded, Unavailable)
from imerge.core.identity import certificate_names, require_worker
from imerge.core.limits import check_block_ids, clip
from imerge.wire.datapath import (HEADER, READ_CHUNK_BYTES, ChannelClosed, FrameHeader, Kind, channel_token,
                                  error_meta, expect, host_queued_bytes, read_head, read_header, read_meta,
                                  send_frame, skip)
from imerge.wire.encoding import push_of, tensor_meta
from imerge.wire.rpc import ps_pb2

from .admission import Admission, AdmissionLimits
from .config import PSConfig
from .block import BlockState
from .direct import Wakeup, pull_here, push_here
from .pace import Pace, payload_budget_s
from .state import Shard
from .turns import PullTurns

log = logging.getLogger(__name__)
T = TypeVar("T")
DRAIN_BYTES = 64 << 20      # what a refused call may still read of what the worker had written
DRAIN_S = 2.0               # and for at most this long


class ChannelStream:
    """A connection as the push's row sees it: how long it has been silent, and a way to end it; and its
    payloads, read by the data plane (:mod:`imerge.core.native`)."""

    def __init__(self, conn: socket.socket, min_bytes_per_s: float = 0.0, window_s: float = 10.0,
                 plane: DataPlane | None = None):
        self.conn = conn
        self.plane = plane or data_plane("python")
        self.last = time.monotonic()
        self.superseded = ""
        self._min_bytes_per_s, self._window_s = min_bytes_per_s, window_s
        self.pace: Pace | None = None  # while a payload is read: it must keep the minimum rate
        self.payload_until: float | None = None  # and arrive by then, if a push waits for its row

    @contextlib.contextmanager
    def payload(self, nbytes: int = 0) -> Iterator[None]:
        """While a payload of ``nbytes`` is read, its bytes must keep --stream-min-bytes-per-s (between calls
        the connection may idle), and a push waiting for the row ends it once its budget is spent."""
        self.pace = Pace(self._min_bytes_per_s, self._window_s)
        budget = payload_budget_s(nbytes, self._min_bytes_per_s)
        self.payload_until = time.monotonic() + budget if budget is not None else None
        try:
            yield
        finally:
            self.pace, self.payload_until = None, None

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        count = self.conn.recv_into(buffer, nbytes)
        self._moved(count)
        return count

    @property
    def plain(self) -> socket.socket | None:
        """The plain socket the frames pass unchanged (None: TLS), which the data plane reads and writes."""
        return self.conn if type(self.conn) is socket.socket else None

    def read_head(self, max_payload: int, what: str) -> tuple[FrameHeader, bytes]:
        """The next frame's header and the bytes of its meta that came with it (:func:`read_head`)."""
        header, received = read_head(self, max_payload, what)
        self._moved(HEADER.size + len(received))
        return header, received

    def read_payload(self, target: memoryview, what: str, check_finite: bool) -> bool:
        """Fill ``target`` (a tensor's bytes) from the connection; with ``check_finite``, return whether its
        float32 elements are all finite (checked as they arrive). The data plane returns at least every
        :data:`~imerge.core.native.PAUSE_S` for the idle check; the rate is checked as bytes arrive."""
        received, finite, size = 0, True, len(target)
        while received < size:
            count, part_finite, state = self.plane.recv_into(self.conn, target, received, check_finite)
            received, finite = received + count, finite and part_finite
            if count:
                self._moved(count)
            if state == RECV_CLOSED:
                raise ChannelClosed(f"{what}: the connection closed after {received} of {size} bytes")
            timeout = self.conn.gettimeout()
            if state == RECV_TIMEOUT or (not count and timeout is not None and self.idle_for() >= timeout):
                raise TimeoutError(f"{what}: nothing for {timeout}s")
        return finite

    def _moved(self, count: int) -> None:
        self.last = time.monotonic()
        if self.pace is not None:
            self.pace.moved(count)
            self._check_pace()

    def _check_pace(self) -> None:
        too_slow = self.pace.too_slow() if self.pace is not None else ""
        if too_slow:
            raise DeadlineExceeded(f"data connection: {too_slow}")

    def budget_left_s(self) -> float | None:
        """Seconds left of the budget of the payload being read (None: none is)."""
        until = self.payload_until
        return until - time.monotonic() if until is not None else None

    def stalled(self, seconds: float) -> bool:
        """Silent, or reading a payload below the minimum rate, for the last ``seconds``."""
        return self.idle_for() >= seconds or (self.pace is not None and self.pace.stalled(seconds))

    def sendall(self, data: Any) -> None:
        self.conn.sendall(data)

    def sendmsg(self, buffers: Sequence[Any]) -> int:
        return self.conn.sendmsg(buffers)

    def idle_for(self) -> float:
        return time.monotonic() - self.last

    def supersede(self, why: str) -> None:
        """End the connection: the read it waits in fails, and the push holding the row with it."""
        self.superseded = why
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)


class Handoff:
    """The connection's thread reads a payload for the coroutine that applies the frame, once that coroutine
    has checked the frame and knows where the bytes go."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._requests: queue.SimpleQueue[
            tuple[memoryview | None, int, bool, asyncio.Future[Any]] | BaseException | None] = queue.SimpleQueue()

    async def read(self, target: memoryview | None, nbytes: int, check_finite: bool = False) -> bool:
        """On the loop: have ``nbytes`` read into ``target`` (None: read and dropped) by the connection's thread;
        return whether the float32 elements are all finite (checked as they arrived) if ``check_finite``."""
        done = self._loop.create_future()
        self._requests.put((target, nbytes, check_finite, done))
        finite: bool = await done
        return finite

    def abort(self, exc: BaseException) -> None:
        """From any thread: ``serve`` raises ``exc`` instead of waiting on (the loop stopped: the coroutine
        will neither ask for a read nor end)."""
        self._requests.put(exc)

    def serve(self, future: concurrent.futures.Future[Any], stream: ChannelStream, what: str) -> Any:
        """On the connection's thread: answer the coroutine's reads until it is done; return its result."""
        future.add_done_callback(lambda _: self._requests.put(None))
        while (request := self._requests.get()) is not None:
            if isinstance(request, BaseException):
                raise request
            target, nbytes, check_finite, done = request
            try:
                with stream.payload(nbytes):
                    if target is None:
                        skip(stream, nbytes, what)
                        outcome: Any = True
                    else:
                        outcome = stream.read_payload(target, what, check_finite)
                failed = False
            except BaseException as exc:  # noqa: BLE001 - the coroutine raises it
                outcome, failed = exc, True
            hand_over(self._loop, done, outcome, failed)
        return future.result()


class SocketPayload:
    """A push frame's payload, as :class:`~.payloads.PayloadSource`: read by the connection's thread."""

    def __init__(self, handoff: Handoff, stream: ChannelStream, nbytes: int, idle_s: float):
        self._handoff, self._stream, self._nbytes, self._idle_s = handoff, stream, nbytes, idle_s

    def declare(self, nbytes: int, what: str) -> None:
        if nbytes != self._nbytes:
            raise InvalidArgument(f"{what}: the frame declares {self._nbytes} bytes of payload, the block's is "
                                  f"{nbytes} bytes in the push's encoding")

    async def read_into(self, target: torch.Tensor, what: str, check_finite: bool = False) -> bool | None:
        view = tensor_view(target)
        if len(view) != self._nbytes:
            raise InvalidArgument(f"{what}: the frame carries {self._nbytes} bytes of payload, the block's is "
                                  f"{len(view)} bytes")
        finite = await self._read(view, what, check_finite)
        return finite if check_finite else None

    async def skip(self) -> None:
        await self._read(None, "duplicate push")

    async def _read(self, view: memoryview | None, what: str, check_finite: bool = False) -> bool:
        with payload_errors(self._stream, what, self._idle_s):
            return await self._handoff.read(view, self._nbytes, check_finite)


class FramePayload:
    """A push frame's payload, read by the connection's thread itself (:func:`~.direct.push_here`)."""

    def __init__(self, stream: ChannelStream, nbytes: int, idle_s: float):
        self.stream, self.nbytes, self._idle_s = stream, nbytes, idle_s

    def read_into(self, target: memoryview, what: str, check_finite: bool) -> bool:
        with payload_errors(self.stream, what, self._idle_s), self.stream.payload(self.nbytes):
            return self.stream.read_payload(target, what, check_finite)


@contextlib.contextmanager
def payload_errors(stream: ChannelStream, what: str, idle_s: float) -> Iterator[None]:
    """A payload's read failing, as the push's refusal: silent too long, superseded, or the connection failed."""
    try:
        yield
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: the client sent nothing for {idle_s:g}s (--stream-idle-s)") from None
    except OSError as exc:
        if stream.superseded:
            raise Superseded(f"{what}: {stream.superseded}") from None
        raise Unavailable(f"{what}: the data connection failed: {exc}") from None


class Link:
    """One accepted connection, as the channel's table holds it: its socket (the TLS socket once wrapped) and
    the generation its HELLO named (-1 before it)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.generation = -1
        self.busy = False     # a call is being served (its answer goes out before a retired link ends)
        self.retired = False  # its generation is over: it ends when its call does
        self.ended = False
        self.wake: Callable[[], None] | None = None  # ends the call's wait for the event loop (see end)

    def retire(self) -> None:
        """End the connection now if it idles, else once its call is answered (a waiting pull gets its
        StaleGeneration, not a reset)."""
        self.retired = True
        if not self.busy:
            self.end()

    def end(self) -> None:
        """Shut the connection down from any thread: the read its thread waits in fails, and so does a wait for
        the event loop (a pull's blocks, a push's coroutine), which a stopped loop would never end."""
        self.ended = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if (wake := self.wake) is not None:
            wake()

    @contextlib.contextmanager
    def waking(self, wake: Callable[[], None]) -> Iterator[None]:
        """While the call waits for the loop, ``end`` calls ``wake`` (at once if the link has already ended)."""
        self.wake = wake
        try:
            if self.ended:
                wake()
            yield
        finally:
            self.wake = None


class DataChannel:
    """The shard's data channel: a listening socket, a thread per connection, and the table of connections
    (:mod:`.admission`): strangers get a few places and a few seconds to say HELLO."""

    def __init__(self, shard: Shard, config: PSConfig, loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None = None):
        self.shard, self.config, self.loop, self.tls = shard, config, loop, tls
        self._secret = secrets.token_bytes(32)
        self._listener: socket.socket | None = None
        self._admission: Admission[Link] = Admission(AdmissionLimits(
            config.max_data_connections, min(config.max_pending_data_connections, config.max_data_connections),
            config.handshake_timeout_s))
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.turns = PullTurns(config.pull_order)
        self.port = 0

    def token(self, worker: int, generation: int) -> bytes:
        return channel_token(self._secret, worker, generation)

    def start(self) -> int:
        listener = socket.create_server((self.config.host, self.config.data_port), backlog=256)
        self._listener, self.port = listener, listener.getsockname()[1]
        name = f"ps{self.shard.index}-data"
        threading.Thread(target=self._accept, args=(listener,), name=f"{name}-accept", daemon=True).start()
        threading.Thread(target=self._reap, name=f"{name}-reap", daemon=True).start()
        return self.port

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.end()

    def end_generations_before(self, generation: int) -> None:
        """The job moved to ``generation`` (a recovery): the connections of older ones end, each once its call in
        flight is answered (a connection never outlives the generation of its HELLO; a stranger's HELLO of an
        older generation is refused)."""
        with self._lock:
            old = [link for link in self._links if 0 <= link.generation < generation]
        for link in old:
            link.retire()
        if old:
            log.info("shard %d: generation %d: %d data connections of older generations ended", self.shard.index,
                     generation, len(old))

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            link = Link(conn)
            with self._lock:
                placed, evicted = self._admission.accept(link, time.monotonic())
                if placed:
                    self._links.add(link)
                self.shard.counters.strangers_ended += len(evicted)
            for stranger in evicted:  # the oldest connections that have not said HELLO make room
                stranger.end()
            if not placed:
                threading.Thread(target=self._refuse, args=(conn,), daemon=True).start()
                continue
            threading.Thread(target=self._serve, args=(link, peer), daemon=True,
                             name=f"ps{self.shard.index}-data").start()

    def _reap(self) -> None:
        """End the connections that did not complete their handshake and HELLO within --handshake-timeout-s."""
        while not self._stopped.is_set():
            now = time.monotonic()
            with self._lock:
                late = self._admission.expired(now)
                next_deadline = self._admission.next_deadline()
                self.shard.counters.strangers_ended += len(late)
            for link in late:
                link.end()
            self._stopped.wait(0.5 if next_deadline is None else min(0.5, max(next_deadline - now, 0.01)))

    def admit(self, link: Link, generation: int) -> bool:
        """The connection's HELLO was accepted: it keeps its place (False: it was ended meanwhile)."""
        with self._lock:
            admitted = self._admission.admit(link)
        if admitted:
            link.generation = generation
        return admitted

    def _refuse(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            send_frame(conn, Kind.ERROR, error_meta(Busy(
                f"shard {self.shard.index}: all {self.config.max_data_connections} data connections are held by "
                f"workers (--max-data-connections): try again"), ps_pb2.ChannelError))
        conn.close()

    def _serve(self, link: Link, peer: Any) -> None:
        conn = link.sock
        try:
            conn.settimeout(self.config.handshake_timeout_s)  # the TLS handshake and the HELLO: see _reap
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:  # the link holds the TLS socket before the handshake: the reaper can end it
                conn = link.sock = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            stream = ChannelStream(conn, self.config.stream_min_bytes_per_s, self.config.stream_idle_s,
                                   self.shard.plane)
            Connection(self, stream, peer, link).serve()
        except OSError as exc:  # a reset, a failed handshake (ssl.SSLError), an eviction, a write to a gone worker
            log.debug("shard %d: data connection from %s ended: %s", self.shard.index, peer, exc)
        finally:
            with self._lock:
                self._admission.release(link)
                self._links.discard(link)
            conn.close()

    def check_hello(self, hello: ps_pb2.ChannelHello, names: list[str] | None) -> None:
        self.shard.check_generation(hello.generation, f"data connection of worker {hello.worker}")
        if not secrets.compare_digest(hello.token, self.token(hello.worker, hello.generation)):
            raise PermissionDenied(f"data connection of worker {hello.worker}: its token is not the one "
                                   f"OpenChannel gave worker {hello.worker} for generation {hello.generation}")
        if self.config.tls_worker_identity:
            require_worker(names or [], hello.worker, "data connection")


class Connection:
    """One data connection: a HELLO, then calls (a push of some blocks, or a pull), one at a time."""

    def __init__(self, channel: DataChannel, stream: ChannelStream, peer: Any, link: Link):
        self.channel, self.stream, self.peer, self.link = channel, stream, peer, link
        self.shard, self.config = channel.shard, channel.config
        self.max_payload = self.shard.max_block_numel * 8  # a sparse payload: int32 index and value per element
        self.worker = -1

    def serve(self) -> None:
        try:
            self._hello()
            while True:
                try:
                    header, received = self.stream.read_head(self.max_payload, "data connection")
                except ChannelClosed as exc:
                    if exc.clean:
                        return
                    raise
                except TimeoutError:  # idle between calls: the worker opens another when it needs one
                    return
                self.link.busy = True
                expect(header, Kind.PUSH, Kind.PULL, what="data connection")
                if header.kind == Kind.PUSH:
                    self._push(header, received)
                else:
                    self._pull(header, received)
                self.link.busy = False
                if self.link.retired:  # the shard restored a newer generation meanwhile
                    return
        except RequestError as exc:
            self._refuse(exc)
        except TimeoutError:
            self._refuse(DeadlineExceeded(
                f"data connection of worker {self.worker}: the client sent nothing for {self.config.stream_idle_s:g}s "
                "within a frame (--stream-idle-s)" if self.worker >= 0 else
                f"data connection: no HELLO within {self.config.handshake_timeout_s:g}s (--handshake-timeout-s)"))
        except OSError as exc:  # the peer closed or reset the connection, or it was ended (evicted, a recovery)
            log.debug("shard %d: data connection of worker %d: %s", self.shard.index, self.worker, exc)
        except Exception as exc:  # noqa: BLE001 - one bad connection never harms the others
            log.exception("shard %d: data connection of worker %d: internal error", self.shard.index, self.worker)
            self._refuse(Internal(f"internal error: {type(exc).__name__}: {exc}"), counted=False)

    def _hello(self) -> None:
        header = read_header(self.stream, self.max_payload, "data connection")
        expect(header, Kind.HELLO, what="data connection's first frame")
        hello = read_meta(self.stream, header, ps_pb2.ChannelHello, "data connection")
        conn = self.stream.conn
        names = certificate_names(conn.getpeercert()) if isinstance(conn, ssl.SSLSocket) else None
        self.channel.check_hello(hello, names)
        if not self.channel.admit(self.link, hello.generation):
            raise ChannelClosed("ended before its HELLO was accepted (--handshake-timeout-s, or evicted by newer "
                                "connections that had not said HELLO either)")
        self.worker = hello.worker
        conn.settimeout(self.config.stream_idle_s)
        send_frame(self.stream, Kind.WELCOME)

    def _check_call(self, worker: int, generation: int, what: str) -> None:
        """A call names the worker and the generation of the connection's HELLO."""
        if worker != self.worker:
            raise PermissionDenied(f"{what}: names worker {worker} on worker {self.worker}'s data connection")
        if generation != self.link.generation:
            raise InvalidArgument(f"{what}: of generation {generation} on a data connection of generation "
                                  f"{self.link.generation} (a connection carries the generation of its HELLO: open "
                                  "another)")

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.channel.loop)

    def _push(self, frame: Any, received: bytes) -> None:
        header = read_meta(self.stream, frame, ps_pb2.PushHeader, "push", received)
        what = f"push of block {clip(header.block_id)} by worker {header.worker}"
        self._check_call(header.worker, header.generation, what)
        push, source = push_of(header), f"data connection from {self.peer[0]}:{self.peer[1]}"
        payload = FramePayload(self.stream, frame.payload_len, self.config.stream_idle_s)
        completed: list[tuple[BlockState, Aggregate]] = []  # the round this push completed: stepped once answered
        try:
            result = push_here(self.shard, push, payload, self.stream, source,
                               lambda block, round_: completed.append((block, round_)))
            duplicate, pushed = result if result is not None else self._push_on_loop(push, payload, source)
            send_frame(self.stream, Kind.RESULT, ps_pb2.BlockPushResult(block_id=header.block_id,
                                                                       duplicate=duplicate, pushed=pushed))
        finally:  # the worker has its answer before the round's step (its slot's flag passes on at once)
            for block, round_ in completed:
                self._start_aggregate(block, round_)

    def _push_on_loop(self, push: Push, payload: FramePayload, source: str) -> tuple[bool, int]:
        """The push as the event loop carries it out (:meth:`Shard.push`), this thread reading its payload."""
        handoff = Handoff(self.channel.loop)
        on_loop = SocketPayload(handoff, self.stream, payload.nbytes, self.config.stream_idle_s)
        future = self._run(self.shard.push(push, on_loop, self.stream, source))
        with self.link.waking(lambda: handoff.abort(ConnectionAbortedError(f"{push.what}: the shard stopped"))):
            result: tuple[bool, int] = handoff.serve(future, self.stream, push.what)
        return result

    def _start_aggregate(self, block: BlockState, round_: Aggregate) -> None:
        """The round's last push was counted here: a round that needs no agreement is averaged and stepped on this
        thread; one that does starts on the event loop (the shards agree there)."""
        if not round_.options.needs_agreement:
            self.shard.aggregate_here(block, round_, self._on_loop)
        else:
            self._on_loop(self.shard.start_aggregate, block, round_)

    def _on_loop(self, function: Callable[..., None], *args: Any) -> None:
        try:
            self.channel.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the shard stopped
            raise Unavailable(f"shard {self.shard.index} stopped") from None

    def _pull(self, frame: Any, received: bytes) -> None:
        request = read_meta(self.stream, frame, ps_pb2.PullRequest, "pull", received)
        self._check_call(request.worker, request.generation, "Pull")
        check_block_ids(request.block_ids, len(self.shard.blocks), "Pull")
        conn = self.stream.conn
        turn = self.channel.turns.ask(self.link, lambda: host_queued_bytes(conn))
        wakeup = Wakeup(turn.ready, turn.idle)
        pulled = pull_here(self.shard, request.block_ids, request.worker, request.round,
                           self.config.pull_wait(request.timeout_s), request.generation, wakeup)
        stopped = ConnectionAbortedError(f"pull by worker {request.worker}: the shard stopped")
        with self.link.waking(lambda: wakeup.end(stopped)), contextlib.closing(pulled), \
                contextlib.closing(turn):
            for blocks in pulled:
                for block_id, round_, snapshot, result in blocks:
                    if waited_s := turn.wait():
                        self.shard.counters.add(pull_turn_waits=1, pull_turn_wait_s=waited_s)
                    send_frame(self.stream, Kind.BLOCK, tensor_meta(block_id, round_, snapshot.dtype,
                                                                    snapshot.numel, snapshot.nnz, result),
                               snapshot.parts)
                    self.shard.counters.add(bytes_sent=snapshot.nbytes)
        send_frame(self.stream, Kind.END)

    def _refuse(self, exc: RequestError, counted: bool = True) -> None:
        """Answer an ERROR frame, read (and drop) what the worker still writes of its call, then let the
        connection close: the worker reads the refusal, not a reset."""
        if counted:
            self.shard.counters.rejected += 1
            log.log(logging.WARNING if self.worker >= 0 else logging.INFO, "rejected on the data channel (%s %s): %s",
                    exc.status, type(exc).__name__, clip(str(exc), 1000))
        with contextlib.suppress(OSError):
            send_frame(self.stream, Kind.ERROR, error_meta(exc, ps_pb2.ChannelError))
            if self.worker < 0:  # a stranger: its HELLO was all it may write
                return
            deadline, drained, scratch = time.monotonic() + DRAIN_S, 0, memoryview(bytearray(READ_CHUNK_BYTES))
            while drained < DRAIN_BYTES and (left := deadline - time.monotonic()) > 0:
                self.stream.conn.settimeout(left)
                if not (count := self.stream.recv_into(scratch)):
                    return
                drained += count
