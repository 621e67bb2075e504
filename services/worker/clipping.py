"""Clipping the way a DDP script does it: ``torch.nn.utils.clip_grad_norm_`` (or ``clip_grad_value_``) on the
model's parameters after backward, applied by the shards to that same round.

A round's gradients leave during its backward, carrying the round's options,
so the shards must know its clipping before its first push. The script's
first round (this engine's first backward) is therefore held: its complete
groups wait on this worker until the script decides, by a clipping call (that
round is clipped, and every later one the same way) or by anything that needs
the round's result (``optimizer.step()``, the next forward, a sync, a save,
``close``): no clipping. From then on each round is pushed during backward
with what the first one decided; a call after a later backward returns that
round's global norm, and one that asks for another clipping than its round
left with (another threshold, clipping started later) raises, naming the
round. A script that clipped after its backward and then skips the call for a
round is refused at the next forward: the shards clipped that round.

``model.clip_grad_norm_(max_norm)`` before the first backward says it in
advance: no round is held. The held round costs one iteration's overlap of
backward and communication, once per process.

Every function takes the :class:`~.hooks.HookState` the hooks share.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from imerge.core.errors import InvalidArgument, UnsupportedUse

from . import rounds
from .iteration import LoopSettings

if TYPE_CHECKING:
    from .hooks import HookState


def holds(state: HookState) -> bool:
    """At a round's backward start: whether its groups wait for the script's clipping (the first round)."""
    settings, loop = state.settings, state.loop
    return not (settings.clipping_known or loop.accumulate or state.policy.schedule.period > 1)


def release(state: HookState) -> None:
    """Something needs the held round: the script did not clip it, nor will it clip any later one."""
    if state.loop.holding:
        _decide(state, 0.0)


def _decide(state: HookState, max_norm: float) -> None:
    """The held round leaves clipped to ``max_norm`` (and by value, where clip_grad_value_ came first)."""
    settings, loop = state.settings, state.loop
    settings.max_norm, settings.clip_value, settings.clipping_known = max_norm, loop.round.clip_value, True
    loop.round = dataclasses.replace(loop.round, max_norm=max_norm)
    loop.holding = False
    held, state.held = state.held, []
    for group in held:  # the backward that completed them has ended (it counted its iteration)
        rounds.enqueue(state, group, loop.round, iteration=loop.iteration - 1)
    if not state.policy.overlap:  # the naive PS: the round's communication right after its backward
        state.waits.all(state.table)


def check_norm_arguments(max_norm: float, norm_type: float) -> float:
    if float(norm_type) != 2.0:
        raise UnsupportedUse(f"clip_grad_norm_ with norm_type {norm_type}: the shards clip by the L2 norm only")
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise InvalidArgument(f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r}")
    return float(max_norm)


def in_advance(settings: LoopSettings, max_norm: float) -> None:
    """``model.clip_grad_norm_`` before the first backward (or the job's join): every round clips to it."""
    settings.max_norm, settings.clipping_known = max_norm, True


def clip_norm(state: HookState, max_norm: float, after_backward: bool) -> None:
    """The script clips the latest round to ``max_norm``: the held round takes it; a later round must have left
    with it (``after_backward``: torch's function, which each round calls)."""
    loop = state.loop
    if loop.holding:
        _decide(state, max_norm)
        state.settings.clips_after_backward = after_backward
    elif not loop.started:
        in_advance(state.settings, max_norm)
        return
    elif loop.round.max_norm != max_norm:
        raise UnsupportedUse(
            f"worker {loop.rank}: clip_grad_norm_({max_norm:g}) after the backward of iteration {loop.iteration - 1}"
            f", whose gradients left during that backward {_clipped(loop.round.max_norm, 'to the norm')}: the "
            "shards clip each round as the first round decided (the first backward's clipping call, or its "
            "absence). Clip every round with the same max_norm from the first one on")
    loop.clipped = True


def clip_value(state: HookState, value: float) -> None:
    """The script clamps the latest round's gradient to [-value, value] (torch.nn.utils.clip_grad_value_)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise InvalidArgument(f"clip_grad_value_: clip_value must be a finite number > 0, got {value!r}")
    loop = state.loop
    if loop.holding:
        loop.round = dataclasses.replace(loop.round, clip_value=float(value))  # clip_grad_norm_ may follow
        state.settings.clips_after_backward = True
        loop.clipped = True
        return
    if not loop.started:
        raise UnsupportedUse("torch.nn.utils.clip_grad_value_ before the first backward: there is no gradient "
                             "to clip; call it after each backward, as with DDP")
    if loop.round.clip_value != value:
        raise UnsupportedUse(
            f"worker {loop.rank}: clip_grad_value_({value:g}) after the backward of iteration {loop.iteration - 1}, "
            f"whose gradients left during that backward {_clipped(loop.round.clip_value, 'by value')}: the "
            "shards clip each round as the first round decided. Clip every round the same way from the first one on")
    loop.clipped = True


def after_held(state: HookState) -> None:
    """At a forward with gradients: the held round is decided; a script that clips after each backward did so
    for the round before (the shards clipped it)."""
    release(state)
    loop = state.loop
    if loop.clip_checked == loop.iteration:  # checked at this round's first forward (micro-batches follow)
        return
    if state.settings.clips_after_backward and loop.iteration and not loop.clipped:
        raise UnsupportedUse(
            f"worker {loop.rank}: the script clipped its gradients after each backward, but not after the "
            f"backward of iteration {loop.iteration - 1}: the shards clipped that round as the first round decided. "
            "Clip every round the same way (or none)")
    loop.clipped, loop.clip_checked = False, loop.iteration


def _clipped(value: float, how: str) -> str:
    return f"clipped {how} at {value:g}" if value else f"not clipped {how}"
