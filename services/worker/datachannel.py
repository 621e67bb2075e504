"""The worker's data channel to one shard: pushes and pulls as frames (:mod:`imerge.wire.datapath`).

Each call (a push of some blocks, or a pull) takes a connection of its own
from a pool, runs on a thread of the channel's pool, and writes each payload
with ``sendall`` straight from the gradient's memory and reads each pulled
block with ``recv_into`` straight into the parameters (both release the GIL).
A connection is opened with the port and the (worker, generation) token that
the shard's ``OpenChannel`` gives (``open_channel``, a gRPC call of
:mod:`.transport`); one idle for more than half the shard's idle limit is
closed rather than reused. A call cancelled on the comm loop shuts its
connection down, which ends the thread's read or write.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import queue
import socket
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from imerge.core.codec import tensor_view
from imerge.core.handover import run_and_hand_over
from imerge.core.errors import Busy, DeadlineExceeded, InvalidArgument, RequestError, Unavailable
from imerge.wire.datapath import (ChannelClosed, FrameHeader, Kind, error_from_meta, expect, read_exact, read_head,
                                  read_meta, send_frame)
from imerge.wire.encoding import push_header
from imerge.wire.rpc import ps_pb2

from .items import BlockArrived, PushItem
from .pulled import PulledBlocks, apply_payload

log = logging.getLogger(__name__)
OpenChannel = Callable[[int, int], Awaitable[ps_pb2.ChannelReply]]  # (worker, generation) -> the shard's reply
REFUSAL_READ_S = 2.0  # a push whose write the shard cut short: how long its refusal may take to be read
CLOSE_THREADS_S = 5.0  # how long a closed channel waits for its threads' calls to end (they were shut down)


class CallThreads:
    """Daemon threads that run the channel's blocking calls, one more whenever none is idle (the comm loop
    bounds the calls in flight). Not concurrent.futures: it refuses new work once the interpreter begins to
    exit, where a model's exit hook still closes the job through its shards. ``close`` ends and joins them: a
    thread still running when the interpreter finalizes dies the first time it takes the GIL back, and torch
    takes it back while freeing a tensor, inside a destructor that may not unwind, which aborts the process."""

    def __init__(self, name: str):
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any],
                                             tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, loop: asyncio.AbstractEventLoop, function: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``function(*args)`` on a thread; its outcome settles the returned future on ``loop`` (cancelling it
        before a thread takes the call skips the call)."""
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self._name}: the data channel is closed")
            thread = threading.Thread(target=self._serve, name=self._name, daemon=True) if self._idle == 0 else None
            if thread is None:
                self._idle -= 1
            else:
                self._threads.append(thread)
        self._tasks.put((loop, future, function, args))
        if thread is not None:
            thread.start()
        return future

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            loop, future, function, args = task
            del task
            run_and_hand_over(loop, future, function, *args)
            del loop, future, function, args  # an idle thread holds no payload (its last call's tensors) and no result
            with self._lock:
                self._idle += 1

    def close(self, timeout_s: float = CLOSE_THREADS_S) -> None:
        """Ends every thread once its call returns (the caller has aborted their connections) and waits up to
        ``timeout_s`` for them all."""
        with self._lock:
            threads, self._threads, self._closed = self._threads, [], True
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [thread for thread in threads if thread.is_alive()]
        if running:
            frames = sys._current_frames()
            waits = "; ".join(f"{thread.name} at {where(frames.get(thread.ident or -1))}" for thread in running)
            log.warning("%d data channel thread(s) still in a call %gs after the channel closed: %s", len(running),
                        timeout_s, waits)


def where(frame: Any) -> str:
    """The innermost calls of a thread's stack (what a thread that does not end is waiting in)."""
    if frame is None:
        return "(gone)"
    return " <- ".join(f"{entry.name} ({entry.filename.rpartition('/')[2]}:{entry.lineno})"
                       for entry in reversed(traceback.extract_stack(frame)[-6:]))


@dataclasses.dataclass(eq=False)
class PooledConnection:
    """A connection of the pool. While a thread is in a call on it, ``abort`` only shuts it down (the thread's
    read or write fails) and the thread closes it once its call returns: closing the descriptor under a call
    that holds its number (the data plane's native loops do, the GIL released) would let the next socket
    opened take that number, and the call would wait on, or read, a stranger's connection."""

    sock: socket.socket
    idle_since: float = 0.0
    _in_call: bool = False
    _aborted: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def abort(self) -> None:
        """End the connection from any thread: shut down now, closed now or when the call in it returns."""
        with self._lock:
            self._aborted, in_call = True, self._in_call
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if not in_call:
            self.sock.close()

    @property
    def aborted(self) -> bool:
        with self._lock:
            return self._aborted

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(sock, *args)`` on the calling thread, unless the connection was aborted first."""
        with self._lock:
            if self._aborted:
                raise ChannelClosed("the connection was ended before its call began")
            self._in_call = True
        try:
            return function(self.sock, *args)
        finally:
            self._call_ended()

    def _call_ended(self) -> None:
        with self._lock:
            self._in_call, aborted = False, self._aborted
        if aborted:  # aborted during the call: closed now that nothing holds its descriptor
            self.sock.close()


class SocketDataPath:
    """Pushes and pulls of one shard on its data channel."""

    def __init__(self, address: str, open_channel: OpenChannel, tls: ssl.SSLContext | None = None):
        self.address = address
        self._host = address.rpartition(":")[0].strip("[]")
        self._open_channel, self._tls = open_channel, tls
        self._replies: dict[tuple[int, int], ps_pb2.ChannelReply] = {}
        self._idle: dict[tuple[int, int, str], list[PooledConnection]] = {}  # (worker, generation, call)
        self._busy: set[PooledConnection] = set()
        self._connecting: set[socket.socket] = set()  # connections before their WELCOME (a thread waits in them)
        self._closed = False
        self._threads = CallThreads("imerge-data")

    async def close(self) -> None:
        self._closed = True
        for connection in [c for pool in self._idle.values() for c in pool] + list(self._busy):
            connection.abort()
        for sock in list(self._connecting):  # a shard that never answers the HELLO holds no thread past close
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._idle.clear()
        self._threads.close()  # on the loop: a thread at the interpreter's exit may not start

    # -- connections ---------------------------------------------------------------------
    async def _connection(self, worker: int, generation: int, kind: str, timeout_s: float) -> PooledConnection:
        """An idle connection of the pool of ``kind`` (pushes and pulls keep their own: a connection that only
        sends keeps the congestion window it grew), else a new one."""
        key = (worker, generation)
        reply = self._replies.get(key)
        if reply is None:  # a new generation: the old one's connections and token are of no more use
            for old in [k for k in self._idle if k[:2] != key]:
                for connection in self._idle.pop(old):
                    connection.abort()
            self._replies = {key: await self._open_channel(worker, generation)}
            reply = self._replies[key]
        pool = self._idle.setdefault((worker, generation, kind), [])
        while pool:
            connection = pool.pop()
            if time.monotonic() - connection.idle_since < reply.idle_s / 2:
                self._busy.add(connection)
                return connection
            connection.abort()  # the shard may be closing it: never reused
        sock = await self._run(self._connect, reply, worker, generation, timeout_s)
        connection = PooledConnection(sock)
        self._busy.add(connection)
        return connection

    def _connect(self, reply: ps_pb2.ChannelReply, worker: int, generation: int, timeout_s: float) -> socket.socket:
        """A new connection through its HELLO. A shard whose table is full (Busy), or that ended the connection
        before its WELCOME (a flood of strangers evicted it), is tried again until ``timeout_s``."""
        deadline, pause = time.monotonic() + timeout_s, 0.01
        while True:
            try:
                return self._connect_once(reply, worker, generation, max(deadline - time.monotonic(), 0.05))
            except (Busy, ChannelClosed, ConnectionResetError, BrokenPipeError) as exc:  # full, or evicted
                if self._closed:
                    raise Unavailable(f"data connection to {self._host}:{reply.port}: the channel was closed",
                                      address=self.address) from None
                if time.monotonic() + pause >= deadline:
                    raise Busy(f"data connection to {self._host}:{reply.port}: no place within {timeout_s:g}s: {exc}",
                               address=self.address) from None
                log.debug("data connection to %s:%d: %s; trying again in %.2fs", self._host, reply.port, exc, pause)
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    def _connect_once(self, reply: ps_pb2.ChannelReply, worker: int, generation: int, timeout_s: float
                      ) -> socket.socket:
        what = f"data connection to {self._host}:{reply.port}"
        sock = raw = socket.create_connection((self._host, reply.port), timeout=timeout_s)
        self._connecting.add(raw)
        try:
            if self._closed:
                raise Unavailable(f"{what}: the channel was closed", address=self.address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if reply.tls:
                if self._tls is None:
                    raise InvalidArgument(f"{what}: the shard's data channel is TLS, but this worker has no "
                                          "--tls-ca to verify it")
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            send_frame(sock, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token, worker=worker,
                                                              generation=generation))
            self._expect(sock, Kind.WELCOME, what)
        except BaseException:
            sock.close()
            raise
        finally:
            self._connecting.discard(raw)
        return sock

    def _release(self, connection: PooledConnection, worker: int, generation: int, kind: str) -> None:
        self._busy.discard(connection)
        if connection.aborted:  # ended (the channel closed) while its call succeeded: not reused
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault((worker, generation, kind), []).append(connection)

    def _expect(self, sock: socket.socket, kind: Kind, what: str, message_type: Any = None
                ) -> tuple[FrameHeader, Any]:
        """The next frame's header, which must be ``kind`` (an ERROR frame raises the shard's error), and its
        meta parsed as ``message_type`` (None: not read; an END frame where a BLOCK was due has none)."""
        header, received = read_head(sock, 0 if kind != Kind.BLOCK else 1 << 62, what)
        if header.kind == Kind.ERROR:
            raise error_from_meta(read_meta(sock, header, ps_pb2.ChannelError, what, received), self.address)
        expect(header, kind, *((Kind.END,) if kind == Kind.BLOCK else ()), what=what)
        if message_type is None or header.kind != kind:
            return header, None
        return header, read_meta(sock, header, message_type, what, received)

    async def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        return await self._threads.submit(asyncio.get_running_loop(), self._translated, function, *args)

    def _translated(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except RequestError:
            raise
        except TimeoutError as exc:
            raise DeadlineExceeded(f"data channel: no answer in time ({exc})", address=self.address) from None
        except (ChannelClosed, OSError) as exc:
            raise Unavailable(f"data channel: {exc}", address=self.address) from None

    async def _call(self, worker: int, generation: int, timeout_s: float, function: Callable[..., Any],
                    *args: Any) -> Any:
        """``function(sock, *args)`` on a pooled connection; the connection goes back to the pool only when the
        call succeeded."""
        kind = function.__name__
        connection = await self._connection(worker, generation, kind, timeout_s)
        try:
            connection.sock.settimeout(timeout_s)
            result = await self._run(connection.call, function, *args)
        except BaseException:  # failed or cancelled: the connection ends (a thread still in it fails)
            self._busy.discard(connection)
            connection.abort()
            raise
        self._release(connection, worker, generation, kind)
        return result

    # -- calls ---------------------------------------------------------------------------
    async def push(self, blocks: list[PushItem], worker: int, timeout_s: float, generation: int = 0, fence: int = 0,
                   lane: int = 0, on_written: Callable[[], None] | None = None) -> ps_pb2.PushReply:
        """Each block's frame, one after another, then the shard's result of each (see ShardClient.push)."""
        loop = asyncio.get_running_loop()
        frames = []
        for item in blocks:
            payload = item.payload
            frames.append((push_header(item.push(worker, generation, fence, lane)), payload.parts()))
        written = functools.partial(loop.call_soon_threadsafe, on_written) if on_written is not None else None
        results = await self._call(worker, generation, timeout_s, self._push, frames, written)
        return ps_pb2.PushReply(results=results)

    def _push(self, sock: socket.socket, frames: list[tuple[ps_pb2.PushHeader, list[memoryview]]],
              on_written: Callable[[], Any] | None) -> list[ps_pb2.BlockPushResult]:
        try:
            for header, parts in frames:
                send_frame(sock, Kind.PUSH, header, parts)
        except (BrokenPipeError, ConnectionResetError) as exc:  # the shard refused a frame and closed
            raise self._refusal_behind(sock, exc) from None
        if on_written is not None:
            on_written()
        results = []
        for header, _ in frames:
            results.append(self._expect(sock, Kind.RESULT, f"push of block {header.block_id}",
                                        ps_pb2.BlockPushResult)[1])
        return results

    def _refusal_behind(self, sock: socket.socket, failed: OSError) -> BaseException:
        """The shard's refusal that cut a push's write short (it answers an ERROR frame, reads what it may of the
        rest and closes: the data that came before the close is still readable), else the failed write."""
        with contextlib.suppress(OSError, ChannelClosed, RequestError):
            sock.settimeout(REFUSAL_READ_S)
            header, received = read_head(sock, 0, "push")
            if header.kind == Kind.ERROR:
                return error_from_meta(read_meta(sock, header, ps_pb2.ChannelError, "push", received), self.address)
        return failed

    async def pull_into(self, targets: list[tuple[str, torch.Tensor]], worker: int, round_: int, timeout_s: float,
                        generation: int = 0, on_block: BlockArrived | None = None) -> list[int]:
        """As ShardClient.pull_into: each block in place as soon as the shard sends it, ``on_block`` told (on the
        connection's thread, in the order the blocks came, before the call returns: it must be thread-safe) as
        each one arrives; a failure of it fails the pull. The new rounds, in the targets' order."""
        request = ps_pb2.PullRequest(block_ids=[b for b, _ in targets], worker=worker, round=round_,
                                     timeout_s=timeout_s, generation=generation)
        pulled = PulledBlocks(targets, "pull", self.address)
        await self._call(worker, generation, timeout_s + 5.0, self._pull, request, pulled,
                         (lambda item: on_block(*item)) if on_block is not None else (lambda item: None))
        return pulled.finish()

    def _pull(self, sock: socket.socket, request: ps_pb2.PullRequest, pulled: PulledBlocks,
              notify: Callable[[Any], Any]) -> None:
        send_frame(sock, Kind.PULL, request)
        while not pulled.complete:
            frame, meta = self._expect(sock, Kind.BLOCK, "pull", ps_pb2.TensorMeta)
            if frame.kind == Kind.END:
                pulled.finish()  # raises: blocks are missing
            self._receive_block(sock, frame.payload_len, meta, pulled)
            notify((meta.block_id, meta.round, meta))
        self._expect(sock, Kind.END, "pull")

    def _receive_block(self, sock: socket.socket, nbytes: int, meta: ps_pb2.TensorMeta, pulled: PulledBlocks) -> None:
        target = pulled.target(meta)
        receiver = pulled.receiver(meta, target)
        place = tensor_view(target) if receiver is None else tensor_view(receiver.buffer)
        what = f"pull: block {meta.block_id}"
        if nbytes != len(place):
            raise InvalidArgument(f"{what}: {nbytes} bytes of payload, expected {len(place)}", address=self.address)
        read_exact(sock, place, what)
        if receiver is not None:
            apply_payload(target, receiver.finish(fed=False))
