"""The job's blocks on the shards as one worker reaches them: created (worker 0), exported, imported, fetched.

Each call spreads over the shards that hold the blocks, one RPC per shard, on
the comm loop. The blocks never change between plans (only their grouping
does), so every call takes the plan's block list.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from imerge.core.optim import OptimizerSpec
from imerge.core.planning import Block, Plan

from .buffers import FlatParams
from .transport import ShardClient
from .wire_compression import Compression


def by_shard(blocks: Iterable[Block]) -> dict[int, list[Block]]:
    grouped: dict[int, list[Block]] = {}
    for block in blocks:
        grouped.setdefault(block.shard, []).append(block)
    return grouped


class ShardBlocks:
    def __init__(self, clients: list[ShardClient], flat: FlatParams, compression: Compression, rpc_timeout_s: float,
                 wait_timeout_s: float, generation: int):
        self.clients, self.flat, self.compression = clients, flat, compression
        self.rpc_timeout_s, self.wait_timeout_s, self.generation = rpc_timeout_s, wait_timeout_s, generation

    async def create(self, plan: Plan, optimizer: OptimizerSpec) -> None:
        """Create every block with this worker's parameters (worker 0, once per job)."""
        self.flat.stage_to_host()
        await asyncio.gather(*(
            self.clients[b.shard].init_block(b.block_id, plan.num_workers, optimizer.group(plan.units[b.unit].group),
                                             self.flat.host_slice(b), self.rpc_timeout_s,
                                             [numel for _, numel in self.flat.pieces(b)],
                                             str(self.compression.mode(b.block_id)))
            for b in plan.blocks))

    async def export(self, blocks: Sequence[Block]) -> dict[str, bytes]:
        """Every block's parameters and optimizer state (safetensors bytes), from its shard."""
        replies = await asyncio.gather(*(
            self.clients[shard].export_blocks([b.block_id for b in held], self.rpc_timeout_s, self.generation)
            for shard, held in by_shard(blocks).items()))
        return {block_id: data for reply in replies for block_id, data in reply.items()}

    async def load(self, blocks: Sequence[Block], states: dict[str, bytes]) -> None:
        """Replace every block's state by ``states`` (block id -> safetensors bytes)."""
        await asyncio.gather(*(
            self.clients[shard].import_blocks({b.block_id: states[b.block_id] for b in held}, self.rpc_timeout_s,
                                              self.generation)
            for shard, held in by_shard(blocks).items()))

    async def fetch(self, blocks: Sequence[Block]) -> dict[str, int]:
        """Every block's current parameters, in place; returns each block's round."""
        grouped = by_shard(blocks)
        replies = await asyncio.gather(*(
            self.clients[shard].fetch_into([(b.block_id, self.flat.host_slice(b)) for b in held],
                                           self.wait_timeout_s, self.generation)
            for shard, held in grouped.items()))
        self.flat.load_from_host(0, self.flat.values.numel())
        return {b.block_id: r for held, reply in zip(grouped.values(), replies) for b, r in zip(held, reply)}
