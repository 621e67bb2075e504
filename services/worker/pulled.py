"""The blocks a pull (or a fetch) asked for, and what the shard sent: one set of checks for every data path.

Each block the shard sends must have been asked for, come once, and have the
target's size; once the reply ends, none may be missing. Where the payload is
compressed (fp16/bf16, or a sparse update) it is received into a buffer and
applied to the target; a dense fp32 block goes straight into the target.
"""
from __future__ import annotations

import torch

from imerge.core.codec import PayloadReceiver
from imerge.core.compression import Payload
from imerge.core.errors import InvalidArgument
from imerge.wire.encoding import dtype_name, nnz_of
from imerge.wire.rpc import ps_pb2


def apply_payload(target: torch.Tensor, payload: Payload) -> None:
    """Write a pulled payload into the parameters: dense values widened, a sparse update at its indices."""
    if payload.sparse:
        target[payload.index.long()] = payload.values.float()
    else:
        target.copy_(payload.values)


class PulledBlocks:
    """The targets of one pull, by block id, and the rounds of the blocks that arrived."""

    def __init__(self, targets: list[tuple[str, torch.Tensor]], what: str, address: str):
        self._order = [block_id for block_id, _ in targets]
        self._pending = dict(targets)
        self.rounds: dict[str, int] = {}
        self.what, self.address = what, address

    def target(self, meta: ps_pb2.TensorMeta) -> torch.Tensor:
        """The target of the block ``meta`` announces (checked: asked for, not yet come, the target's size)."""
        target = self._pending.pop(meta.block_id, None)
        if target is None:
            raise InvalidArgument(f"{self.what}: the shard sent block {meta.block_id!r}, which was not asked for or "
                                  "came twice", address=self.address)
        if meta.numel != target.numel():
            raise InvalidArgument(f"{self.what}: block {meta.block_id} has {meta.numel} elements, expected "
                                  f"{target.numel()}", address=self.address)
        self.rounds[meta.block_id] = meta.round
        return target

    def receiver(self, meta: ps_pb2.TensorMeta, target: torch.Tensor) -> PayloadReceiver | None:
        """Where a compressed block is received before :func:`apply_payload` (None: a dense fp32 block, which
        goes straight into ``target``)."""
        if meta.dtype == ps_pb2.FLOAT32 and meta.encoding == ps_pb2.DENSE:
            return None
        what = f"{self.what}: block {meta.block_id}"
        return PayloadReceiver(target.numel(), dtype_name(meta.dtype, what), nnz_of(meta), what)

    @property
    def complete(self) -> bool:
        return not self._pending

    def finish(self) -> list[int]:
        """The new rounds, in the order asked; InvalidArgument naming the blocks the reply left out."""
        if self._pending:
            raise InvalidArgument(f"{self.what}: the shard sent {len(self.rounds)} of {len(self._order)} blocks; "
                                  f"missing {sorted(self._pending)}", address=self.address)
        return [self.rounds[block_id] for block_id in self._order]
