"""Flat tensors as raw little-endian bytes, split into and rebuilt from chunks.

Pure: imports neither grpc nor redis. Only fp32 travels today; the dtype
table (:mod:`imerge.core.dtypes`) is where another element type would be added.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch

from imerge.core.errors import InvalidArgument

CHUNK_BYTES = 1 << 20
assert sys.byteorder == "little", "IMerge sends tensors as little-endian memory"


def tensor_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("tensor_view needs a contiguous CPU tensor")
    return memoryview(flat.detach().numpy()).cast("B")


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
