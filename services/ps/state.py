"""The shard's blocks and the round protocol, independent of gRPC.

A block holds flat fp32 parameters, their optimizer and a round counter (the
number of completed aggregations). Gradients of round ``r`` are received into
one preallocated row per worker; when every worker pushed, the rows are summed
in worker-id order, divided by the worker count and handed to ``torch.optim``.
The new parameters are serialized once, already cut into the chunks that go
on the wire, into a snapshot that every pull of that round is answered with.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import AsyncIterator

import torch

from imerge.codec import ChunkAssembler, digest, iter_chunks, tensor_view
from imerge.errors import (AlreadyExists, DeadlineExceeded, FailedPrecondition,
                           InvalidArgument, NotFound)
from imerge.optim import OptimizerSpec

from .metrics import ShardCounters, ShardMetrics

log = logging.getLogger(__name__)


def snapshot_of(param: torch.Tensor) -> list[bytes]:
    """The parameters as the wire chunks every pull sends (one copy, shared by all pulls)."""
    return list(iter_chunks(tensor_view(param)))


@dataclasses.dataclass(frozen=True)
class BlockMeta:
    block_id: str
    dtype: str
    numel: int
    num_workers: int
    optimizer: OptimizerSpec


class BlockState:
    def __init__(self, meta: BlockMeta, init: torch.Tensor, init_digest: str):
        self.meta = meta
        self.init_digest = init_digest
        self.param = torch.nn.Parameter(init, requires_grad=True)
        self.optimizer = meta.optimizer.build([self.param])
        self.grads = torch.zeros(meta.num_workers, meta.numel)
        self.round = 0
        self.pushed: set[int] = set()
        self.receiving: set[int] = set()
        self.row_locks = [asyncio.Lock() for _ in range(meta.num_workers)]
        self.snapshot = snapshot_of(self.param)
        self.changed = asyncio.Condition()

    def missing_workers(self) -> list[int]:
        return sorted(set(range(self.meta.num_workers)) - self.pushed)

    def aggregate(self, metrics: ShardMetrics) -> list[bytes]:
        """Average the pushed gradients in worker-id order and step (runs off the event loop)."""
        with metrics.aggregation.time(), torch.no_grad():
            mean = self.grads[0].clone()
            for row in self.grads[1:]:
                mean.add_(row)
            mean.div_(self.meta.num_workers)
        self.param.grad = mean
        with metrics.optimizer_step.time():
            self.optimizer.step()
        self.param.grad = None
        return snapshot_of(self.param)


class Shard:
    def __init__(self, index: int, *, check_finite: bool = True, max_block_numel: int = 1 << 28,
                 max_workers: int = 4096, link_mbps: float = 10000.0):
        self.index = index
        self.check_finite = check_finite
        self.max_block_numel = max_block_numel
        self.max_workers = max_workers
        self.blocks: dict[str, BlockState] = {}
        self.counters = ShardCounters()
        self.metrics = ShardMetrics(index, self.counters, link_mbps)
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"ps{index}-step")
        self._tasks: set[asyncio.Task] = set()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # -- validation (before any allocation) ---------------------------------
    def check_meta(self, meta: BlockMeta) -> None:
        if not meta.block_id:
            raise InvalidArgument("block_id is empty")
        if meta.dtype != "float32":
            raise InvalidArgument(f"block {meta.block_id}: dtype {meta.dtype} is not supported (float32 only)")
        if not 0 < meta.numel <= self.max_block_numel:
            raise InvalidArgument(f"block {meta.block_id}: numel {meta.numel} outside 1..{self.max_block_numel}")
        if not 0 < meta.num_workers <= self.max_workers:
            raise InvalidArgument(f"block {meta.block_id}: num_workers {meta.num_workers} "
                                  f"outside 1..{self.max_workers}")
        meta.optimizer.validate()

    def block(self, block_id: str) -> BlockState:
        try:
            return self.blocks[block_id]
        except KeyError:
            raise NotFound(f"block {block_id!r} is not on shard {self.index}") from None

    def _check_worker(self, block: BlockState, worker: int) -> None:
        if not 0 <= worker < block.meta.num_workers:
            raise InvalidArgument(f"block {block.meta.block_id}: worker {worker} outside "
                                  f"0..{block.meta.num_workers - 1}")

    # -- init -----------------------------------------------------------------
    def create_block(self, meta: BlockMeta, init: torch.Tensor) -> tuple[bool, int]:
        """First writer wins; an identical init is accepted, a different one rejected."""
        init_digest = digest(tensor_view(init))
        existing = self.blocks.get(meta.block_id)
        if existing is None:
            self.blocks[meta.block_id] = BlockState(meta, init, init_digest)
            self.metrics.blocks.set(len(self.blocks))
            log.info("block %s: %d elements, %d workers, %s", meta.block_id, meta.numel,
                     meta.num_workers, meta.optimizer.name)
            return True, 0
        if existing.meta != meta:
            raise AlreadyExists(f"block {meta.block_id} exists with a different spec: "
                                f"{existing.meta} vs {meta}")
        if existing.init_digest != init_digest:
            raise AlreadyExists(f"block {meta.block_id} exists with different initial parameters")
        return False, existing.round

    # -- push -----------------------------------------------------------------
    async def push(self, block_id: str, worker: int, round_: int, dtype: str, numel: int,
                   data: AsyncIterator[bytes]) -> tuple[bool, int]:
        """Receive one worker's gradient for a round; return (duplicate, workers pushed so far).

        Pushes of the same (block, worker) are serialized by a lock, so a malformed
        push never blocks or spoils a good one; a repeat of a counted push is
        drained and acknowledged as a duplicate.
        """
        block = self.block(block_id)
        self._check_worker(block, worker)
        what = f"push of block {block_id} by worker {worker} for round {round_}"
        if dtype != block.meta.dtype or numel != block.meta.numel:
            raise InvalidArgument(f"{what}: got {numel} x {dtype}, the block holds "
                                  f"{block.meta.numel} x {block.meta.dtype}")
        async with block.row_locks[worker]:
            if round_ == block.round - 1 or (round_ == block.round and worker in block.pushed):
                async for _ in data:
                    pass
                self.counters.duplicate_pushes += 1
                return True, len(block.pushed)
            if round_ != block.round:
                raise FailedPrecondition(f"{what}: the block's current round is {block.round}")
            block.receiving.add(worker)
            self.metrics.pushes_in_flight.inc()
            try:
                assembler = ChunkAssembler(block.grads[worker], what)
                async for chunk in data:
                    assembler.feed(chunk)
                assembler.finish()
                if self.check_finite and not bool(torch.isfinite(block.grads[worker]).all()):
                    raise InvalidArgument(f"{what}: gradient holds NaN or infinity")
            finally:
                block.receiving.discard(worker)
                self.metrics.pushes_in_flight.dec()
            return False, self._count_push(block, worker)

    def _count_push(self, block: BlockState, worker: int) -> int:
        """Count a complete push; start the aggregation when it was the last one."""
        block.pushed.add(worker)
        self.counters.pushes += 1
        self.counters.bytes_received += block.meta.numel * 4
        if len(block.pushed) == block.meta.num_workers:
            task = asyncio.get_running_loop().create_task(self._aggregate(block))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(block.pushed)

    async def _aggregate(self, block: BlockState) -> None:
        snapshot = await asyncio.get_running_loop().run_in_executor(self._executor, block.aggregate, self.metrics)
        async with block.changed:
            block.snapshot = snapshot
            block.round += 1
            block.pushed.clear()
            self.counters.rounds_completed += 1
            block.changed.notify_all()

    # -- pull -----------------------------------------------------------------
    async def pull(self, block_id: str, worker: int, round_: int, timeout_s: float) -> tuple[int, list[bytes]]:
        """Wait until every worker pushed ``round_``; return (new round, parameters)."""
        block = self.block(block_id)
        self._check_worker(block, worker)
        what = f"pull of block {block_id} by worker {worker} for round {round_}"
        self.counters.pulls += 1
        if round_ == block.round - 1:
            return block.round, block.snapshot
        if round_ != block.round:
            raise FailedPrecondition(f"{what}: the block's current round is {block.round}")
        if worker not in block.pushed and worker not in block.receiving:
            raise FailedPrecondition(f"{what}: worker {worker} has not pushed this round")
        try:
            with self.metrics.pull_wait.time():
                async with block.changed:
                    await asyncio.wait_for(block.changed.wait_for(lambda: block.round > round_), timeout_s)
        except asyncio.TimeoutError:
            missing = block.missing_workers()
            reason = (f"workers {missing} have not pushed" if missing else "the aggregation is still running")
            raise DeadlineExceeded(f"{what}: timed out after {timeout_s:g}s; {reason}") from None
        return block.round, block.snapshot

    def fetch(self, block_id: str) -> tuple[int, list[bytes]]:
        block = self.block(block_id)
        return block.round, block.snapshot
