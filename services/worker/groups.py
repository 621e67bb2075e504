"""The fusion groups of the current plan on this worker, and their syncs.

Who writes what (the training thread and the comm thread share these):

* :class:`GroupRuntime` is the training thread's: it alone writes every field
  (which parameters got a gradient, the round it pushed last, its latest
  :class:`Sync`, the blocks it has not waited for). The comm thread only reads
  the immutable parts (blocks, shards).
* A :class:`Sync` is made by the training thread when it queues the group, and
  frozen; the comm thread answers through its thread-safe parts only: it sets
  ``pushed`` once the last block is out and resolves the Futures.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import torch

from imerge.core.errors import IMergeError
from imerge.core.planning import BYTES_PER_ELEMENT, Block, Group, Plan
from imerge.core.rounds import RoundOptions

from .buffers import FlatParams
from .staging import DONE, Ready


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What the shards say of a completed round besides its parameters."""

    skipped: bool     # the step was skipped: the loss scale let an inf or NaN through
    grad_norm: float  # the global norm of the averaged gradient (when clipping or unscaling; else 0)


@dataclasses.dataclass(frozen=True, eq=False)
class Sync:
    """One sync of a group: the round its pushes are of (the shards then complete ``round + 1``), what each
    block's push says, when its gradients may be read, and how the comm thread answers: ``pushed`` (every block
    out: the accumulator's slice may be overwritten), the group's Future and each block's (the round pulled)."""

    group: GroupRuntime
    round: int
    iteration: int  # counted from the schedule's start (the timeline's label)
    options: dict[str, RoundOptions]  # block id -> its round's options (its param group's hyperparameters)
    no_grad: dict[str, tuple[int, ...]]  # block id -> its pieces this worker gave no gradient since the last sync
    ready: Ready = DONE  # when the group's gradients may be read for the wire (a device copy's event)
    pushed: threading.Event = dataclasses.field(default_factory=threading.Event)
    future: concurrent.futures.Future[int] = dataclasses.field(default_factory=concurrent.futures.Future)
    block_futures: dict[str, concurrent.futures.Future[int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.block_futures.update({b.block_id: concurrent.futures.Future() for b in self.group.blocks})

    def fail(self, exc: BaseException) -> None:
        """Route a failed sync to whoever waits on the group or on any of its blocks; its pushes are over."""
        for waiting in (self.future, *self.block_futures.values()):
            if not waiting.done():
                waiting.set_exception(exc)
        self.pushed.set()


class GroupRuntime:
    """One fusion group's sync state on this worker (the training thread's)."""

    def __init__(self, group: Group, blocks: list[Block], params: list[torch.nn.Parameter], round_: int):
        self.group = group
        self.blocks = blocks
        self.params = params
        self.param_ids = {id(p) for p in params}
        self.round = round_  # the round its latest sync completes (its blocks' round when none is in flight)
        self.by_shard: dict[int, list[Block]] = {}
        for block in blocks:
            self.by_shard.setdefault(block.shard, []).append(block)
        self.seen: set[int] = set()  # parameters whose gradient arrived in this backward
        self.given: set[int] = set()  # parameters that got a gradient since the group's last sync
        self.latest: Sync | None = None  # the latest sync queued
        self.unsettled: set[str] = set()  # blocks of the latest sync the training thread has not waited for yet
        self.dirty = False  # the accumulator's slice holds a pushed gradient (overwritten piece by piece: grads.py)

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def nbytes(self) -> int:
        return self.group.numel * BYTES_PER_ELEMENT

    def pushed(self) -> bool:
        """Whether the latest sync's pushes are out (no sync: nothing to wait for)."""
        return self.latest is None or self.latest.pushed.is_set()

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
        # the group whose latest sync answers "what did the shards say of the latest round" until this table's own
        # last group has synced: after a plan switch, the previous table's (see :meth:`handed_over`)
        self.latest_of_previous: GroupRuntime | None = None
        for group in plan.groups:
            members = [p for p in params if group.offset <= flat.range[id(p)][0] < group.offset + group.numel]
            blocks = plan.group_blocks(group)
            rounds = {block_rounds[b.block_id] for b in blocks}
            if len(rounds) != 1:
                raise IMergeError(_uneven_rounds(group.index, {b.block_id: block_rounds[b.block_id] for b in blocks}))
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

    def block_rounds(self) -> dict[str, int]:
        return {b.block_id: g.round for g in self.groups for b in g.blocks}

    def handed_over(self, previous: "GroupTable") -> "GroupTable":
        """This table, taking over from ``previous`` (a plan switch between two iterations): the result of the round
        pushed last (the loss scaler's overflow, the clipped norm) is read from ``previous`` until this table syncs
        its own first round."""
        last = previous.groups[-1]
        self.latest_of_previous = last if last.latest is not None else previous.latest_of_previous
        return self

    def last_synced(self) -> GroupRuntime | None:
        """The group whose latest sync carries the latest round's result: the last group (the first layers), or
        before it synced under this plan, the previous plan's."""
        last = self.groups[-1]
        return last if last.latest is not None else self.latest_of_previous


def _uneven_rounds(group: int, rounds: dict[str, int]) -> str:
    """Why a group's blocks are at different rounds: a block's round completed that not every worker of the job
    pushed (the workers push and pull a group's blocks together)."""
    ahead = max(rounds.values())
    names = sorted(block for block, round_ in rounds.items() if round_ == ahead)
    return (f"group {group}: its blocks are at different rounds {sorted(set(rounds.values()))} ({', '.join(names[:3])}"
            f"{' ...' if len(names) > 3 else ''} at round {ahead}): rounds of theirs completed that this job's workers "
            "did not all push; another client pushes as a worker of this job (the shards log its address), or the "
            "shards hold another job's blocks")
