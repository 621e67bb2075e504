"""A push's payload on the shard: its encoding checked against the block's compression mode, then received.

A dense fp32 gradient is written straight into the worker's row; an fp16 or
bf16 one is widened into it; a top-k one is kept sparse, as it came, until the
round averages. A payload is applied only once it arrived whole and its
indices are in range: a bad one leaves the block as it was.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

import torch

from imerge.core.codec import ChunkAssembler, PayloadReceiver
from imerge.core.compression import WIRE_DTYPES, Payload, expected_encoding
from imerge.core.errors import InvalidArgument

from .block import BlockMeta, BlockState


def describe(dtype: str, nnz: int) -> str:
    return f"dense {dtype}" if nnz < 0 else f"sparse {dtype} ({nnz} pairs)"


def check_encoding(meta: BlockMeta, assign: bool, dtype: str, nnz: int, what: str) -> None:
    """Refuse a payload whose encoding is not the one the block's mode makes (an assignment is dense fp32)."""
    if dtype not in WIRE_DTYPES:
        raise InvalidArgument(f"{what}: dtype {dtype} is not one of {', '.join(WIRE_DTYPES)}")
    want_dtype, want_sparse = ("float32", False) if assign else expected_encoding(meta.mode)
    if (dtype, nnz >= 0) != (want_dtype, want_sparse):
        raise InvalidArgument(f"{what}: a {describe(dtype, nnz)} payload, but the block's compression is "
                              f"{str(meta.mode) or 'none'!r}, "
                              f"whose {'assignments' if assign else 'gradients'} travel "
                              f"{'sparse' if want_sparse else 'dense'} {want_dtype}")
    if nnz > meta.numel:
        raise InvalidArgument(f"{what}: {nnz} sparse pairs, more than the block's {meta.numel} elements")


class PayloadSource(Protocol):
    """Where a push's payload comes from: a gRPC stream's data chunks, or a data channel's frame."""

    def declare(self, nbytes: int, what: str) -> None:
        """The payload must be ``nbytes`` (the block's size in the push's encoding): InvalidArgument now, before
        a byte is read or skipped, if the source declared another length; and no more is ever read."""

    async def read_into(self, target: torch.Tensor, what: str, check_finite: bool = False) -> bool | None:
        """Fill the contiguous CPU tensor ``target`` with the payload (InvalidArgument if its size differs);
        with ``check_finite``, return whether it is all finite if the source checked it as it read (else
        None: the caller checks)."""

    async def skip(self) -> None:
        """Read and drop the payload (a duplicate push)."""


class Budgeted(Protocol):
    """A stream whose block payloads must each arrive within their size at the minimum rate."""

    def payload(self, nbytes: int) -> contextlib.AbstractContextManager[None]: ...


class ChunkStream:
    """A gRPC push's payload: its data chunks, copied into place as they arrive (a chunk stream declares no
    length: it is held to the declared one as it comes)."""

    def __init__(self, chunks: AsyncIterator[bytes], stream: Budgeted | None = None):
        self._chunks, self._stream = chunks, stream
        self._nbytes: int | None = None

    def declare(self, nbytes: int, what: str) -> None:
        self._nbytes = nbytes

    def _budget(self) -> contextlib.AbstractContextManager[None]:
        if self._stream is None or self._nbytes is None:
            return contextlib.nullcontext()
        return self._stream.payload(self._nbytes)

    async def read_into(self, target: torch.Tensor, what: str, check_finite: bool = False) -> bool | None:
        assembler = ChunkAssembler(target, what)
        with self._budget():
            async for chunk in self._chunks:
                assembler.feed(chunk)
        assembler.finish()
        return None

    async def skip(self) -> None:
        received = 0
        with self._budget():
            async for chunk in self._chunks:
                received += len(chunk)
                if self._nbytes is not None and received > self._nbytes:
                    raise InvalidArgument(f"duplicate push: more than the block's {self._nbytes} bytes")
        if self._nbytes is not None and received != self._nbytes:
            raise InvalidArgument(f"duplicate push: {received} of the block's {self._nbytes} bytes arrived")


async def receive_gradient(block: BlockState, worker: int, dtype: str, nnz: int, data: PayloadSource,
                           what: str, check_finite: bool = False) -> tuple[torch.Tensor, bool | None]:
    """Receive the worker's payload into its place on the block; return what arrived (whose values must be
    finite) and, with ``check_finite``, whether they are if the source checked it as it read (else None)."""
    if dtype == "float32" and nnz < 0:  # no compression: straight into the row
        row = block.grads[worker]
        return row, await data.read_into(row, what, check_finite)
    receiver = PayloadReceiver(block.meta.numel, dtype, nnz, what)
    await data.read_into(receiver.buffer, what)
    payload = receiver.finish(fed=False)
    if nnz >= 0:
        block.sparse_grads[worker] = payload
        return payload.values, None
    block.grads[worker].copy_(payload.values)
    return block.grads[worker], None


async def receive_copy(block: BlockState, dtype: str, nnz: int, data: PayloadSource, what: str) -> Payload:
    """The payload as the block would keep it (dense: widened to fp32), received aside, the block untouched."""
    if dtype == "float32" and nnz < 0:
        values = torch.empty(block.meta.numel)
        await data.read_into(values, what)
        return Payload(values)
    receiver = PayloadReceiver(block.meta.numel, dtype, nnz, what)
    await data.read_into(receiver.buffer, what)
    payload = receiver.finish(fed=False)
    return payload if nnz >= 0 else Payload(payload.values.float())


def same_payload(block: BlockState, worker: int, payload: Payload) -> bool:
    """Whether the worker's row holds ``payload``, bit for bit (NaN included)."""
    if payload.sparse:
        kept = block.sparse_grads[worker]
        return kept is not None and _same_bits(kept.index, payload.index) and _same_bits(kept.values,
                                                                                              payload.values)
    return _same_bits(block.grads[worker], payload.values)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
