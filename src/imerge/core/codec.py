"""Flat tensors as raw little-endian bytes, split into and rebuilt from chunks.

Pure: imports neither grpc nor redis. A block's parameters are fp32; on the
wire they may travel compressed (:mod:`imerge.core.compression`), which
:class:`PayloadReceiver` reads back.
"""
from __future__ import annotations

import hashlib
import sys

from typing import TYPE_CHECKING

import numpy as np
import torch

from imerge.core.errors import InvalidArgument

if TYPE_CHECKING:
    from imerge.core.compression import Payload

CHUNK_BYTES = 1 << 20
assert sys.byteorder == "little", "IMerge sends tensors as little-endian memory"


def tensor_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("tensor_view needs a contiguous CPU tensor")
    return flat.detach().numpy().data.cast("B")


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class ChunkAssembler:
    """Copies incoming chunks into a preallocated flat tensor.

    ``feed`` rejects a chunk that would overflow the declared size before
    copying it; ``finish`` rejects a stream that ended early.
    """

    def __init__(self, target: torch.Tensor, what: str):
        self._target = target.detach().numpy().reshape(-1)
        self._what = what
        self._offset = 0

    def feed(self, data: bytes) -> None:
        if len(data) % self._target.itemsize:
            raise InvalidArgument(f"{self._what}: chunk of {len(data)} bytes is not a whole number "
                                  f"of {self._target.itemsize}-byte elements")
        count = len(data) // self._target.itemsize
        if self._offset + count > self._target.size:
            raise InvalidArgument(f"{self._what}: stream carries more than the declared "
                                  f"{self._target.size} elements")
        self._target[self._offset:self._offset + count] = np.frombuffer(data, dtype=self._target.dtype)
        self._offset += count

    def finish(self) -> None:
        if self._offset != self._target.size:
            raise InvalidArgument(f"{self._what}: stream truncated: {self._offset} of "
                                  f"{self._target.size} declared elements arrived")


class PayloadReceiver:
    """Collects the bytes of one compressed payload (exactly its declared size) and decodes it.

    ``nnz`` -1 is a dense payload of ``numel`` elements of ``dtype``; otherwise ``nnz`` int32 indices followed by
    ``nnz`` values, whose indices :func:`finish` checks. The buffer is bounded by the block's size.
    """

    def __init__(self, numel: int, dtype: str, nnz: int, what: str):
        from imerge.core.compression import WIRE_DTYPES
        from imerge.core.modes import INDEX_BYTES

        self._dtype, self._numel, self._nnz, self._what = WIRE_DTYPES[dtype], numel, nnz, what
        itemsize = self._dtype.itemsize
        self._index_bytes = max(nnz, 0) * INDEX_BYTES
        size = self._index_bytes + nnz * itemsize if nnz >= 0 else numel * itemsize
        self.buffer = torch.empty(size, dtype=torch.uint8)  # what arrives, read straight into it or fed
        self._assembler = ChunkAssembler(self.buffer, what)

    def feed(self, data: bytes) -> None:
        self._assembler.feed(data)

    def finish(self, fed: bool = True) -> Payload:
        """The payload; ``fed``: its bytes came through :meth:`feed` (else they were written into ``buffer``)."""
        from imerge.core.compression import Payload, check_sparse

        if fed:
            self._assembler.finish()
        values = self.buffer[self._index_bytes:].view(self._dtype)
        if self._nnz < 0:
            return Payload(values)
        indices = self.buffer[:self._index_bytes].view(torch.int32)
        check_sparse(indices, self._numel, self._what)
        return Payload(values, indices, self._numel)
