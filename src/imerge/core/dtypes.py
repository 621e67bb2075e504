"""The element types tensors travel as. Pure: no torch, grpc or redis.

Blocks are flat vectors of ``BLOCK_DTYPE``; every byte count of a block is
``numel * BLOCK_DTYPE.itemsize``. Another element type is added here.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DType:
    name: str
    numpy: str      # numpy's little-endian type string
    itemsize: int   # bytes per element


DTYPES = {"float32": DType("float32", "<f4", 4)}
BLOCK_DTYPE = DTYPES["float32"]
