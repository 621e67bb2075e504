"""The shard's request streams, parsed: pure, no gRPC.

Deserializers never raise: bytes that are not the method's message become an
:class:`Undecodable`, which the servicer's choke point turns into
INVALID_ARGUMENT. Streams are read into exactly the declared size before any
tensor of that size is allocated.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import torch
from google.protobuf.message import DecodeError

from imerge.core.codec import ChunkAssembler
from imerge.wire.frames import deserializer
from imerge.core.dtypes import BLOCK_DTYPE
from imerge.core.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Superseded
from imerge.core.handover import hand_over
from imerge.core.limits import MAX_ROW_WAITERS, STALLED_S, check_id, clip

from .pace import Pace, payload_budget_s

HEADER_BYTES = 64  # what a message that is not data counts for in a stream's rate


class Undecodable:
    """What the deserializer hands on for bytes that are not the method's message (gRPC would answer UNKNOWN)."""

    def __init__(self, kind: str, error: Exception):
        self.what = f"a message that is not a valid {kind}: {error}"


def parser(message_type: Any) -> Callable[[bytes], Any]:
    """The method's deserializer: data frames as views (no copy), other messages by protobuf, garbage as an
    Undecodable."""
    parse_message = deserializer(message_type)

    def parse(data: bytes) -> Any:
        try:
            return parse_message(data)
        except DecodeError as exc:
            return Undecodable(message_type.DESCRIPTOR.full_name, exc)

    return parse


def decoded(request: Any) -> Any:
    """The request with undecodable messages turned into INVALID_ARGUMENT (streams: as they arrive)."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.what)
    if hasattr(request, "__aiter__"):
        return _decoded_stream(request)
    return request


async def _decoded_stream(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for message in stream:
        if isinstance(message, Undecodable):
            raise InvalidArgument(message.what)
        yield message


class Progressing:
    """A client stream that must keep moving: each message within ``idle_s`` of the previous one, and at least
    ``min_bytes_per_s`` over each window of ``idle_s`` (:class:`~.pace.Pace`), or the call ends with
    DEADLINE_EXCEEDED (and frees whatever it held); :meth:`supersede` ends it at its next wait. Its rate counts
    only the time the server waited for the client, not the server's own work between two messages."""

    def __init__(self, stream: AsyncIterator[Any], idle_s: float, what: str, min_bytes_per_s: float = 0.0):
        self._messages = aiter(stream)
        self.idle_s = idle_s
        self.what = what
        self._timeout: asyncio.Timeout | None = None
        self._superseded = ""
        self._loop = asyncio.get_running_loop()
        self._waited = 0.0  # seconds spent waiting for the client's messages (the server's own work not counted)
        self._wait_started: float | None = None
        self.pace = Pace(min_bytes_per_s, idle_s, self._waiting_clock)
        self.payload_until: float | None = None  # while a block's payload is read: when its budget ends

    @contextlib.contextmanager
    def payload(self, nbytes: int) -> Iterator[None]:
        """While a block's payload of ``nbytes`` is read: a push waiting for the row ends it once its budget
        (:func:`~.pace.payload_budget_s`) is spent."""
        budget = payload_budget_s(nbytes, self.pace.min_bytes_per_s)
        self.payload_until = time.monotonic() + budget if budget is not None else None
        try:
            yield
        finally:
            self.payload_until = None

    def budget_left_s(self) -> float | None:
        """Seconds left of the budget of the payload being read (None: none is)."""
        until = self.payload_until
        return until - time.monotonic() if until is not None else None

    def _waiting_clock(self) -> float:
        """The stream's clock: it runs only while the server waits for the client."""
        now = self._loop.time()
        return self._waited + (now - self._wait_started if self._wait_started is not None else 0.0)

    def __aiter__(self) -> "Progressing":
        return self

    async def __anext__(self) -> Any:
        self._check()
        self._wait_started = self._loop.time()
        try:
            async with asyncio.timeout(self.idle_s) as self._timeout:
                message = await anext(self._messages)
        except TimeoutError:
            self._check()
            raise DeadlineExceeded(f"{self.what}: the client sent nothing for {self.idle_s:g}s "
                                   f"(--stream-idle-s)") from None
        finally:
            self._timeout = None
            self._waited += self._loop.time() - self._wait_started
            self._wait_started = None
        self.pace.moved(len(message.data) if message.WhichOneof("part") == "data" else HEADER_BYTES)
        too_slow = self.pace.too_slow()
        if too_slow:
            raise DeadlineExceeded(f"{self.what}: {too_slow}")
        return message

    def idle_for(self) -> float:
        """Seconds the server has waited since the last message came."""
        return self.pace.idle_for()

    def stalled(self, seconds: float) -> bool:
        """Silent, or below the minimum rate, for the last ``seconds``."""
        return self.pace.stalled(seconds)

    def supersede(self, why: str) -> None:
        """End the stream: at once if it waits for a message, else at its next wait."""
        if self._superseded:  # another waiter ended it already (its timeout may have expired meanwhile)
            return
        self._superseded = why
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())

    def _check(self) -> None:
        if self._superseded:
            raise Superseded(f"{self.what}: {self._superseded}")


async def first_part(stream: AsyncIterator[Any], field: str, what: str) -> Any:
    first = await anext(aiter(stream), None)
    if first is None:
        raise InvalidArgument(f"{what}: empty stream")
    if first.WhichOneof("part") != field:
        raise InvalidArgument(f"{what}: the first message must carry the {field}")
    return getattr(first, field)


async def data_parts(stream: AsyncIterator[Any], what: str) -> AsyncIterator[bytes]:
    """The data chunks of the rest of a stream; a second header is an error."""
    async for chunk in stream:
        if chunk.WhichOneof("part") != "data":
            raise InvalidArgument(f"{what}: only the first message may carry a header")
        yield chunk.data


async def receive_exact(chunks: AsyncIterator[bytes], numel: int, what: str) -> torch.Tensor:
    """The stream's fp32 elements; nothing of the declared size is allocated before that many bytes arrived."""
    pieces, received, expected = [], 0, numel * BLOCK_DTYPE.itemsize
    async for data in chunks:
        received += len(data)
        if received > expected:
            raise InvalidArgument(f"{what}: stream carries more than the declared {numel} elements")
        pieces.append(data)
    if received != expected:
        raise InvalidArgument(f"{what}: stream truncated: {received // BLOCK_DTYPE.itemsize} of {numel} declared "
                              f"elements arrived")
    tensor = torch.empty(numel)
    assembler = ChunkAssembler(tensor, what)
    for data in pieces:
        assembler.feed(data)
    assembler.finish()
    return tensor


async def receive_states(stream: AsyncIterator[Any], bound: Callable[[str, int], int],
                         expected: Callable[[int], Awaitable[None]] | None = None) -> tuple[int, dict[str, bytes]]:
    """An Import stream's (generation, block id -> state bytes). Each block is named once, with the generation of
    the others, and declares at most ``bound(block_id, generation)`` bytes (which raises for an unknown block),
    all checked when its meta arrives, before a byte of its data is kept; ``expected(generation)`` raises where
    no import of that generation is expected (checked at the first meta)."""
    states: dict[str, bytes] = {}
    meta: Any = None
    parts: list[bytes] = []
    received, generation = 0, None
    async for chunk in stream:
        if chunk.WhichOneof("part") == "meta":
            if meta is not None:
                raise InvalidArgument(f"Import: block {meta.block_id} got {received} of {meta.nbytes} bytes")
            meta, parts, received = chunk.meta, [], 0
            check_id(meta.block_id, "Import")
            if meta.block_id in states:
                raise InvalidArgument(f"Import: block {clip(meta.block_id)} is named twice")
            if generation is not None and meta.generation != generation:
                raise InvalidArgument(f"Import: generations {generation} and {meta.generation} in one stream")
            if generation is None and expected is not None:
                await expected(meta.generation)
            generation, most = meta.generation, bound(meta.block_id, meta.generation)
            if meta.nbytes > most:
                raise InvalidArgument(f"Import: block {meta.block_id}: {meta.nbytes} bytes, more than its state "
                                      f"can take ({most})")
        elif meta is None:
            raise InvalidArgument("Import: data before a block's meta")
        else:
            parts.append(chunk.data)
            received += len(chunk.data)
            if received > meta.nbytes:
                raise InvalidArgument(f"Import: block {meta.block_id}: more than {meta.nbytes} bytes")
        if meta is not None and received == meta.nbytes:
            states[meta.block_id], meta = b"".join(parts), None
    if meta is not None:
        raise InvalidArgument(f"Import: block {meta.block_id} got {received} of {meta.nbytes} bytes")
    if not states or generation is None:
        raise InvalidArgument("Import: empty stream (no block's state)")
    return generation, states


class Segments:
    """A push stream as segments: a header, then that block's data chunks."""

    def __init__(self, stream: AsyncIterator[Any]):
        self._messages = aiter(stream)
        self._pending: Any = None
        self._started = False

    async def next_header(self) -> Any:
        message, self._pending = self._pending or await anext(self._messages, None), None
        if message is None:
            if not self._started:
                raise InvalidArgument("Push: empty stream")
            return None
        if message.WhichOneof("part") != "header":
            raise InvalidArgument("Push: every segment must start with a header")
        self._started = True
        return message.header

    async def data(self) -> AsyncIterator[bytes]:
        async for message in self._messages:
            if message.WhichOneof("part") == "header":
                self._pending = message
                return
            yield message.data

    async def drain(self, limit_bytes: int) -> None:
        """Read (and drop) what the client still sends, up to ``limit_bytes``: a client still writing when the
        call ends sees a broken write (gRPC's INTERNAL "Internal error from Core"), not the status we answer."""
        seen = 0
        async for message in self._messages:
            seen += len(message.data) if message.WhichOneof("part") == "data" else 64
            if seen > limit_bytes:
                return


class Row:
    """One worker's row of a block: pushes of it are serialized. A push of this round or a later one that waits
    supersedes the stream holding the row once that stream sent nothing, or less than the minimum rate, for
    ``STALLED_S`` (a stalled, dripping or abandoned push never holds up its retry for longer) or once its payload
    took longer than its budget (its size at the minimum rate: nobody holds a row another push waits for longer),
    and a push of the block's current round supersedes a holder of an older round (a duplicate, whose bytes
    change nothing) at once; at most ``MAX_ROW_WAITERS`` wait. The event loop waits for the row (:meth:`held`);
    a data connection's thread takes it only where it is free and nobody waits (:meth:`try_hold`)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below: the loop and the connections' threads hold rows
        self._locked = False
        self._wakers: list[Callable[[], Any]] = []  # the loop's waiters, each told once when the row is freed
        self.holder: tuple[int, Progressing] | None = None  # (round, the push stream holding the row)
        self.waiters = 0

    def locked(self) -> bool:
        return self._locked

    def try_hold(self, round_: int, stream: Any) -> bool:
        """From any thread, never waiting: the row for a push of ``round_`` if it is free and no push waits for it
        (False: nothing was taken). The caller must :meth:`release` it."""
        with self._mutex:
            if self._locked or self.waiters:
                return False
            self._locked, self.holder = True, (round_, stream)
        return True

    def release(self) -> None:
        with self._mutex:
            self._locked, self.holder = False, None
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    @contextlib.asynccontextmanager
    async def held(self, round_: int, stream: Progressing | None, what: str,
                   current_round: Callable[[], int] = lambda: -1) -> AsyncIterator[None]:
        """The row, for a push of ``round_``; ``current_round()`` is the block's round now: a holder of an older
        round than that is a duplicate, which a push of the current round supersedes at once."""
        if self.waiters >= MAX_ROW_WAITERS:
            raise ResourceExhausted(f"{what}: {MAX_ROW_WAITERS} pushes of this worker already wait for the block")
        self.waiters += 1
        try:
            looked = False
            while True:
                holder = self.holder
                why = _why_superseded(holder, round_, current_round(), looked) if holder is not None else ""
                if holder is not None and why:
                    holder[1].supersede(f"{why} while a newer {what} waited")
                if await self._acquired(_next_look(self.holder), (round_, stream) if stream is not None else None):
                    break
                looked = True
        finally:
            self.waiters -= 1
        try:
            yield
        finally:
            self.release()

    async def _acquired(self, timeout_s: float, holder: tuple[int, Any] | None) -> bool:
        """Whether the row was taken (for ``holder``) within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._mutex:
                if not self._locked:
                    self._locked, self.holder = True, holder
                    return True
                freed: asyncio.Future[None] = loop.create_future()
                wake = functools.partial(hand_over, loop, freed, None, False)
                self._wakers.append(wake)
            try:
                async with asyncio.timeout_at(deadline):
                    await freed
            except TimeoutError:
                with self._mutex:
                    if wake in self._wakers:
                        self._wakers.remove(wake)
                return False


def _why_superseded(holder: tuple[int, Any], round_: int, current: int, looked: bool) -> str:
    """Why a push of ``round_`` that waits for the row ends its ``holder`` ("" while it may go on): the holder
    pushes a duplicate (an older round than the block's ``current`` one, which this push is of); its payload
    has taken longer than its budget; or (``looked``: after the waiter's look of ``STALLED_S``) it sent nothing,
    or less than the minimum rate, over that second."""
    held_round, stream = holder
    if held_round < current <= round_:
        return f"a duplicate of round {held_round}"
    if round_ < held_round:
        return ""
    if looked and stream.stalled(STALLED_S):
        return f"sent nothing, or less than the minimum rate, for {STALLED_S:g}s"
    left = stream.budget_left_s()
    if left is not None and left <= 0:
        return "its payload took longer than its size at the minimum rate (--stream-min-bytes-per-s)"
    return ""


def _next_look(holder: tuple[int, Any] | None) -> float:
    """How long a waiter waits before it looks at the holder again: a second, or until its budget ends."""
    left = holder[1].budget_left_s() if holder is not None else None
    return STALLED_S if left is None else min(STALLED_S, max(left, 0.01))
