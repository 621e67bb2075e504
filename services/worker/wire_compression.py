"""The worker's side of compression: each block's compressor (and its error-feedback residual), and the wire
bytes of what goes out and comes back.

A block's mode is fixed when the job's first plan is made (see
:func:`imerge.core.modes.block_modes`); its compressor lives as long as
the worker's engine, so a top-k residual carries over from one round to the
next. Compression runs on the comm thread, once per sync of a block, after
the group's device copy completed.
"""
from __future__ import annotations

import bisect
from typing import Any

import torch

from imerge.core.compression import Compressor, Payload, all_finite, make_compressor
from imerge.core.modes import BlockMode, payload_bytes
from imerge.core.errors import UnsupportedUse
from imerge.core.planning import BYTES_PER_ELEMENT
from imerge.wire.encoding import dtype_name, nnz_of

NO_COMPRESSION = BlockMode()


def payload_nbytes(payload: Payload | torch.Tensor) -> int:
    return payload.nbytes if isinstance(payload, Payload) else payload.numel() * BYTES_PER_ELEMENT


def meta_nbytes(meta: Any) -> int:
    """The wire bytes of a pulled block, from its TensorMeta."""
    return payload_bytes(meta.numel, dtype_name(meta.dtype, "pull"), nnz_of(meta))


class Compression:
    def __init__(self, modes: dict[str, BlockMode]):
        self.modes = modes  # block id -> its mode (none where absent)
        self._compressors: dict[str, Compressor] = {}

    def mode(self, block_id: str) -> BlockMode:
        return self.modes.get(block_id, NO_COMPRESSION)

    def compress(self, block: Any, grad: torch.Tensor, scaled: bool = False) -> Payload | torch.Tensor:
        """The block's payload. An fp16 payload that overflowed is an error, unless the gradient is loss-scaled
        (``scaled``: the grad scaler expects the overflow, and the shards skip the round)."""
        mode = self.mode(block.block_id)
        if not mode.compressed:
            return grad
        compressor = self._compressors.get(block.block_id)
        if compressor is None:
            compressor = self._compressors[block.block_id] = make_compressor(mode, block.numel)
        payload = compressor.compress(grad)[0]
        if mode.kind == "fp16" and not scaled and not all_finite(payload.values) and all_finite(grad):
            raise UnsupportedUse(f"block {block.block_id}: a gradient element beyond fp16's range (65504) "
                                 f"became infinite with --compression fp16; use bf16 (fp32's range), or a grad "
                                 f"scaler (model.grad_scaler()), which skips such a round")
        return payload

    def estimate(self, block: Any) -> int:
        """The bytes a push of the block will carry (before it is compressed)."""
        return self.mode(block.block_id).push_bytes(block.numel)

    @staticmethod
    def still_without_grad(block: Any, payload: Payload, no_grad: tuple[int, ...], flat: Any) -> tuple[int, ...]:
        """The pieces without gradient that the payload carries nothing of. A top-k payload may carry a piece's
        residual from earlier rounds although the piece got no gradient now: that piece is stepped with it."""
        if not payload.sparse:
            return no_grad
        starts, start = [], 0
        for _, numel in flat.pieces(block):
            starts.append(start)
            start += numel
        starts.append(start)
        indices = payload.index.tolist()
        kept = []
        for piece in no_grad:
            first = bisect.bisect_left(indices, starts[piece])
            if first == len(indices) or indices[first] >= starts[piece + 1]:
                kept.append(piece)
        return tuple(kept)
