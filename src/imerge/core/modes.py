"""How each block travels, as data: the compression modes, a run's :class:`CompressionSpec`, a block's
:class:`BlockMode` and the bytes a payload takes on the wire. Pure and free of torch, so that the roles that only
plan or decide (the coordinator, the simulator) load no tensor library; :mod:`imerge.core.compression` holds the
tensors' side.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from imerge.core.errors import ConfigError

if TYPE_CHECKING:
    from imerge.core.planning import Plan

MODES = ("none", "fp16", "bf16", "topk", "mixed")
CAST_MODES = {"fp16": "float16", "bf16": "bfloat16"}
WIRE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per element of each wire dtype
INDEX_BYTES = 4  # int32: a block holds at most 2**31 - 1 elements


@dataclasses.dataclass(frozen=True)
class BlockMode:
    """How one block's data travel: ``kind`` (none, fp16, bf16, topk), the top-k ``ratio`` of a push, and the
    most a pull sends of the block (``pull_ratio``; 0: every parameter that changed)."""

    kind: str = "none"
    ratio: float = 0.0
    pull_ratio: float = 0.0

    def __str__(self) -> str:
        if self.kind != "topk":
            return "" if self.kind == "none" else self.kind
        return f"topk:{self.ratio:g}" + (f":{self.pull_ratio:g}" if self.pull_ratio else "")

    @property
    def cast(self) -> str:
        """The wire dtype of a dense payload."""
        return CAST_MODES.get(self.kind, "float32")

    @property
    def sparse(self) -> bool:
        """Whether a push carries (index, value) pairs (top-k)."""
        return self.kind == "topk"

    @property
    def compressed(self) -> bool:
        return self.kind != "none"

    def push_bytes(self, numel: int) -> int:
        """The wire bytes a push of a block of ``numel`` elements carries (the sending kernel's byte credit)."""
        if self.sparse:
            return payload_bytes(numel, "float32", topk_count(self.ratio, numel))
        return payload_bytes(numel, self.cast, -1)


def topk_count(ratio: float, numel: int) -> int:
    """Elements a top-k payload of a block of ``numel`` carries: ceil(ratio * numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def payload_bytes(numel: int, dtype: str, nnz: int) -> int:
    """The wire bytes of a payload: dense (``nnz`` -1) or ``nnz`` (index, value) pairs."""
    itemsize = WIRE_ITEMSIZE[dtype]
    return numel * itemsize if nnz < 0 else nnz * (INDEX_BYTES + itemsize)


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """What a run compresses: ``mode`` (none, fp16, bf16, topk, mixed), the top-k ``ratio``, and for mixed the
    group size under which a group goes fp16 (``threshold_bytes``) rather than top-k."""

    mode: str = "none"
    ratio: float = 0.01
    threshold_bytes: int = 256 << 10
    pull_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("--compression", f"{self.mode!r} is not one of {', '.join(MODES)}")
        if not 0 < self.ratio <= 1:
            raise ConfigError("--topk-ratio", f"{self.ratio} is not in (0, 1]")
        if self.threshold_bytes < 0:
            raise ConfigError("--mixed-threshold-kib", f"{self.threshold_bytes / 1024:g} is negative")
        if not 0 <= self.pull_ratio <= 1:
            raise ConfigError("--topk-pull-ratio", f"{self.pull_ratio} is not in [0, 1]")

    def block_mode(self, group_bytes: int) -> BlockMode:
        """The mode of a block of a group of ``group_bytes`` (fp32) bytes."""
        topk = BlockMode("topk", self.ratio, self.pull_ratio)
        if self.mode == "mixed":
            return BlockMode("fp16") if group_bytes < self.threshold_bytes else topk
        if self.mode == "topk":
            return topk
        return BlockMode(self.mode)


def block_modes(spec: CompressionSpec, plan: Plan) -> dict[str, BlockMode]:
    """Each block's mode, by the size of its group in ``plan`` (the job's first plan: a block keeps its mode when a
    cost plan regroups the blocks later)."""
    modes: dict[str, BlockMode] = {}
    for group in plan.groups:
        for index in group.blocks:
            modes[plan.blocks[index].block_id] = spec.block_mode(group.numel * 4)
    return modes
