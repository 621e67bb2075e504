"""The plan: model layout, fusion groups, blocks and their placement on shards.

Pure policy: imports neither grpc nor redis. The coordinator computes a
:class:`Plan` from the workers' :class:`Layout` and publishes it as JSON;
workers and shards read it back with :meth:`Plan.from_json`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from .errors import LayoutMismatchError, PlanError


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    module: str  # qualified name of the module that owns the parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The trainable parameters of a model, in backward order (first ready first)."""

    params: tuple[ParamInfo, ...]

    def to_json(self) -> str:
        return json.dumps([[p.name, list(p.shape), p.module] for p in self.params])

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        return cls(tuple(ParamInfo(name, tuple(shape), module) for name, shape, module in json.loads(text)))

    def check_same(self, other: "Layout", self_rank: int, other_rank: int) -> None:
        """Raise LayoutMismatchError naming the first parameter where the two differ."""
        for index, (mine, theirs) in enumerate(zip(self.params, other.params)):
            if mine != theirs:
                raise LayoutMismatchError(
                    f"worker {other_rank} disagrees with worker {self_rank} at parameter #{index}: "
                    f"{theirs.name} {list(theirs.shape)} vs {mine.name} {list(mine.shape)}")
        if len(self.params) != len(other.params):
            longer, rank = (self, self_rank) if len(self.params) > len(other.params) else (other, other_rank)
            extra = longer.params[min(len(self.params), len(other.params))]
            raise LayoutMismatchError(
                f"workers {self_rank} and {other_rank} have {len(self.params)} and "
                f"{len(other.params)} parameters; first extra one (worker {rank}): {extra.name}")


@dataclasses.dataclass(frozen=True)
class Group:
    """A fusion group: parameters fused into one flat buffer, in backward order."""

    index: int
    params: tuple[str, ...]
    numel: int


@dataclasses.dataclass(frozen=True)
class Block:
    """A contiguous slice of a group's flat buffer, owned by one shard."""

    block_id: str
    group: int
    offset: int
    numel: int
    shard: int


@dataclasses.dataclass(frozen=True)
class Plan:
    version: int
    num_workers: int
    shard_addresses: tuple[str, ...]
    groups: tuple[Group, ...]
    blocks: tuple[Block, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        return cls(version=raw["version"], num_workers=raw["num_workers"],
                   shard_addresses=tuple(raw["shard_addresses"]),
                   groups=tuple(Group(g["index"], tuple(g["params"]), g["numel"]) for g in raw["groups"]),
                   blocks=tuple(Block(**b) for b in raw["blocks"]))

    def blocks_of_group(self, group: int) -> list[Block]:
        return [b for b in self.blocks if b.group == group]

    def shard_load(self) -> list[int]:
        """Elements per iteration that each shard receives from one worker."""
        load = [0] * len(self.shard_addresses)
        for block in self.blocks:
            load[block.shard] += block.numel
        return load


def groups_per_module(layout: Layout) -> list[Group]:
    """One group per module (WFBP), ordered by when backward first reaches it."""
    order: list[str] = []
    members: dict[str, list[ParamInfo]] = {}
    for param in layout.params:
        if param.module not in members:
            order.append(param.module)
            members[param.module] = []
        members[param.module].append(param)
    return [Group(i, tuple(p.name for p in members[m]), sum(p.numel for p in members[m]))
            for i, m in enumerate(order)]


def place_greedy(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Largest first onto the least-loaded shard (LPT); ties go to the lowest index."""
    if num_shards < 1:
        raise PlanError("placement needs at least one shard")
    load = [0] * num_shards
    shard_of = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(num_shards), key=lambda s: (load[s], s))
        shard_of[item] = target
        load[target] += sizes[item]
    return shard_of


def make_plan(layout: Layout, num_workers: int, shard_addresses: Sequence[str], version: int) -> Plan:
    if not layout.params:
        raise PlanError("the model has no trainable parameters")
    groups = groups_per_module(layout)
    shard_of = place_greedy([g.numel for g in groups], len(shard_addresses))
    blocks = tuple(Block(f"g{g.index}", g.index, 0, g.numel, shard_of[g.index]) for g in groups)
    return Plan(version, num_workers, tuple(shard_addresses), tuple(groups), blocks)
