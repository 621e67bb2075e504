"""What a push carries of each block, and the interface of what carries it: typed, for every data path."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from imerge.core.compression import Payload
from imerge.core.rounds import NO_OPTIONS, Push, RoundOptions


@dataclasses.dataclass(frozen=True)
class PushItem:
    """One block of a push stream: its gradient (an fp32 tensor, or a compressed :class:`Payload`), the round it
    is of, and what the push says besides."""

    block_id: str
    grad: torch.Tensor | Payload
    round: int
    options: RoundOptions = NO_OPTIONS
    no_grad: tuple[int, ...] = ()   # the block's pieces this worker gave no gradient since its last sync

    @property
    def payload(self) -> Payload:
        return self.grad if isinstance(self.grad, Payload) else Payload(self.grad)

    def push(self, worker: int, generation: int, fence: int, lane: int) -> Push:
        """The push of this block by ``worker``, as its header says it (:func:`imerge.wire.encoding.push_header`)."""
        payload = self.payload
        return Push(self.block_id, worker, self.round, payload.dtype, payload.numel,
                    payload.nnz if payload.sparse else -1, generation, fence, lane, self.options, self.no_grad)


BlockArrived = Callable[[str, int, Any], None]  # (block id, its new round, its meta), as soon as it is in place:
# on the comm loop or on a data connection's thread, so it must be thread-safe


class DataPath(Protocol):
    """What carries one shard's pushes and pulls: the data channel (:class:`~.datachannel.SocketDataPath`, the
    default) or gRPC's streams (:class:`~.transport.GrpcDataPath`). Every implementation keeps one contract,
    which ``tests/test_datapath_contract.py`` runs over each: a push's blocks counted in order and acknowledged
    per block (a retry of the same bytes a duplicate, other bytes a second writer), each pulled block written
    into its target as soon as its round completes, refusals raised as the shard's error class before a byte
    of a refused payload is applied, deadlines that name what was waited for."""

    address: str

    async def push(self, blocks: list[PushItem], worker: int, timeout_s: float, generation: int = 0,
                   fence: int = 0, lane: int = 0, on_written: Callable[[], None] | None = None) -> Any:
        """Push the blocks' gradients in one call (``on_written`` called on the caller's loop once the last byte
        is handed over); return the shard's ``PushReply``."""

    async def pull_into(self, targets: list[tuple[str, torch.Tensor]], worker: int, round_: int, timeout_s: float,
                        generation: int = 0, on_block: BlockArrived | None = None) -> list[int]:
        """Wait for ``round_`` of the blocks, each written into its target as it comes (``on_block`` told, on
        any thread, before the call returns; a failure of it fails the pull); return the new rounds in the
        targets' order."""

    async def close(self) -> None: ...
