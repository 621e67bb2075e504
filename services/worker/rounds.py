"""Rounds sent by the training thread: a complete group's sync, and the rounds outside backward.

Every function takes the :class:`~.hooks.HookState` the hooks share (as DDP's
comm hooks take their state object). Outside backward a round is sent by
``flush`` (T > 1: the groups that did not sync last, at ``close``) and
``assign`` (``load_state_dict``: this worker's parameters, of which the shards
keep worker 0's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from imerge.core.errors import UnsupportedUse

from .groups import GroupRuntime, Sync
from .iteration import RoundContext

if TYPE_CHECKING:
    from .hooks import HookState


def enqueue(state: HookState, group: GroupRuntime, context: RoundContext, assign: bool = False,
            iteration: int | None = None) -> None:
    """Queue the group's sync; each block's push carries the round's hyperparameters of its parameter group
    and the pieces of it that got no gradient since the last sync (counted as zeros; one that no worker gave
    a gradient is not stepped, as in torch.optim). ``assign``: the data are parameters to assign;
    ``iteration``: the one whose backward completed the group (default: the current one)."""
    table = state.table
    units = table.plan.units
    options = {b.block_id: context.options(units[b.unit].group, assign) for b in group.blocks}
    no_grad = {b.block_id: tuple(i for i, pid in enumerate(table.pieces_of[b.block_id]) if pid not in group.given)
               for b in group.blocks}
    settle_stale(state, group)
    group.given.clear()
    comm = state.comm
    ready = comm.staging.group_complete(group.group.offset, group.group.numel)  # returns at once
    completed_in = state.loop.iteration if iteration is None else iteration
    sync = Sync(group, group.round, state.policy.schedule.relative(completed_in), options, no_grad, ready)
    group.latest, group.round = sync, group.round + 1  # the round this sync completes
    comm.enqueue(sync)
    group.unsettled = {b.block_id for b in group.blocks}
    group.dirty = True
    state.waits.in_flight.add(group.index)
    state.loop.groups_enqueued += iteration is None  # a held round's groups were its own iteration's


def flush(state: HookState) -> None:
    """With T > 1, sync every group that did not sync in the last iteration (it holds local SGD steps and
    the sum of its gradients since its last sync), so that every worker ends with the shards' parameters."""
    schedule, iteration = state.policy.schedule, state.loop.iteration
    if schedule.period == 1 or iteration == schedule.start:
        return
    context = RoundContext(tuple(state.optimizer.hypers()))
    for group in state.table.groups:
        if not schedule.synced_last(group.index, iteration):
            state.waits.pushed(group, "its previous push to finish")
            enqueue(state, group, context)
    state.waits.all(state.table)


def assign(state: HookState) -> None:
    """Send this worker's parameters to the shards as a round of their own: the shards take worker 0's (every
    worker takes part, at the same point of its loop) and every worker pulls them."""
    if any(group.given for group in state.table.groups):
        raise UnsupportedUse("load_state_dict() inside a gradient accumulation (no_sync): the accumulated "
                             "gradients would be lost; load before the micro-batches or after their step")
    state.waits.all(state.table)
    context = RoundContext(tuple(state.optimizer.hypers()))
    settle_accumulator(state)
    state.flat.grads.copy_(state.flat.values)
    for group in state.table.groups:
        enqueue(state, group, context, assign=True)
    state.waits.all(state.table)


def settle_stale(state: HookState, group: GroupRuntime) -> None:
    """The pieces of the group's last push that no gradient overwrote since count as zeros: they are zeroed once
    that push is out (a group whose slice holds no push is left as it is)."""
    if group.dirty:
        state.waits.pushed(group, "its previous push to finish")
        state.grads.zero_stale(group)


def settle_accumulator(state: HookState) -> None:
    """Every push out and every pushed slice of the accumulator zeroed (before the groups change, or the
    accumulator is used for anything else)."""
    state.comm.staging.before_accumulate()
    for group in state.table.groups:
        state.waits.pushed(group, "its push to finish")
        if group.dirty:
            state.grads.clear(group)
