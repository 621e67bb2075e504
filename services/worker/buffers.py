"""The worker's flat buffers: every trainable parameter is a view into one flat tensor.

Parameters are laid out in the plan's (backward) order, so every unit, block
and group is a contiguous range: a pull writes the parameters in place, with
no per-tensor copy, and a group's gradients are one slice of the gradient
accumulator. With T = 1 each parameter's ``.grad`` is a view of its slice
(DDP's ``gradient_as_bucket_view``): autograd accumulates straight into the
accumulator, and nothing is copied per gradient. On a GPU the accumulator and
the parameters stay on the device; :mod:`.staging` moves them to and from
pinned host buffers without blocking backward.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import threading

import torch

from imerge.core.errors import IMergeError
from imerge.core.planning import BYTES_PER_ELEMENT, Block, Group, Plan


class FlatParams:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.device = params[0].device
        total = sum(p.numel() for p in params)
        pinned = self.device.type == "cuda"
        self.values = torch.empty(total, device=self.device)
        self.host = torch.empty(total, pin_memory=True) if pinned else self.values
        self.grads = torch.zeros(total, device=self.device)  # the sum of gradients since the last sync
        self.host_grads = torch.empty(total, pin_memory=True) if pinned else self.grads  # what a push sends
        self.range: dict[int, tuple[int, int]] = {}
        offset = 0
        with torch.no_grad():
            for param in params:
                if param.device != self.device:
                    raise ValueError(f"all parameters must live on one device; {param.device} != {self.device}")
                view = self.values[offset:offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)
                self.range[id(param)] = (offset, param.numel())
                offset += param.numel()
        self._starts = [start for start, _ in self.range.values()]  # increasing: the layout's order
        self._ids = list(self.range)

    def pieces(self, block: Block) -> list[tuple[int, int]]:
        """(id(param), elements of it in the block) for every parameter the block holds a piece of, in order."""
        end = block.offset + block.numel
        first = max(0, bisect.bisect_right(self._starts, block.offset) - 1)
        pieces = []
        for pid in self._ids[first:]:
            start, numel = self.range[pid]
            if start >= end:
                break
            if block.offset < start + numel:
                pieces.append((pid, min(end, start + numel) - max(block.offset, start)))
        return pieces

    def host_slice(self, block: Block) -> torch.Tensor:
        return self.host[block.offset:block.offset + block.numel]

    def stage_to_host(self) -> None:
        if self.host is not self.values:
            self.host.copy_(self.values)

    def load_from_host(self, offset: int, numel: int) -> None:
        if self.host is not self.values:
            self.values[offset:offset + numel].copy_(self.host[offset:offset + numel])

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The parameter's slice of the gradient accumulator, in its shape (autograd accumulates into it)."""
        offset, numel = self.range[id(param)]
        return self.grads[offset:offset + numel].view_as(param)

    def add_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        offset, numel = self.range[id(param)]
        self.grads[offset:offset + numel].add_(grad.reshape(-1))


class GroupRuntime:
    """One fusion group's sync state on this worker."""

    def __init__(self, group: Group, blocks: list[Block], params: list[torch.nn.Parameter], round_: int):
        self.group = group
        self.blocks = blocks
        self.params = params
        self.param_ids = {id(p) for p in params}
        self.round = round_
        self.by_shard: dict[int, list[Block]] = {}
        for block in blocks:
            self.by_shard.setdefault(block.shard, []).append(block)
        self.seen: set[int] = set()  # parameters whose gradient arrived in this backward
        self.given: set[int] = set()  # parameters that got a gradient since the group's last sync
        self.done_this_backward = False
        self.future: concurrent.futures.Future | None = None  # the latest sync: every block back in place
        self.block_futures: dict[str, concurrent.futures.Future] = {}  # the latest sync, block by block
        self.push_done = threading.Event()
        self.push_done.set()
        self.pull_task = None
        self.unsettled: set[str] = set()  # blocks of the latest sync the training thread has not waited for yet
        self.dirty = False  # the accumulator's slice holds a pushed gradient (zeroed before the next one)

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def nbytes(self) -> int:
        return self.group.numel * BYTES_PER_ELEMENT

    def __repr__(self) -> str:
        return f"group {self.group.index} ({len(self.blocks)} blocks, {self.nbytes} B)"

    def shard_bytes(self, shard: int) -> int:
        return sum(b.numel for b in self.by_shard[shard]) * BYTES_PER_ELEMENT


class GroupTable:
    """The group runtimes of one plan and the lookups the hooks need (blocks never change between plans)."""

    def __init__(self, plan: Plan, flat: FlatParams, params: list[torch.nn.Parameter],
                 block_rounds: dict[str, int]):
        self.plan = plan
        self.groups: list[GroupRuntime] = []
        self.group_of: dict[int, GroupRuntime] = {}  # id(param) -> its group
        self.unit_of: dict[int, int] = {}            # id(param) -> its unit's index
        self.param_group: dict[int, int] = {}        # id(param) -> its optimizer parameter group
        self.blocks_of: dict[int, list[str]] = {}    # id(param) -> the blocks that hold it
        self.pieces_of: dict[str, list[int]] = {b.block_id: [pid for pid, _ in flat.pieces(b)] for b in plan.blocks}
        for group in plan.groups:
            members = [p for p in params if group.offset <= flat.range[id(p)][0] < group.offset + group.numel]
            blocks = plan.group_blocks(group)
            rounds = {block_rounds[b.block_id] for b in blocks}
            if len(rounds) != 1:
                raise IMergeError(f"group {group.index}: its blocks are at different rounds {sorted(rounds)}")
            runtime = GroupRuntime(group, blocks, members, rounds.pop())
            self.groups.append(runtime)
            self.group_of.update({id(p): runtime for p in members})
            for pid in runtime.param_ids:
                start, numel = flat.range[pid]
                self.blocks_of[pid] = [b.block_id for b in blocks
                                       if b.offset < start + numel and start < b.offset + b.numel]
        for unit in plan.units:
            for p in params:
                if unit.offset <= flat.range[id(p)][0] < unit.offset + unit.numel:
                    self.unit_of[id(p)] = unit.index
                    self.param_group[id(p)] = unit.group
