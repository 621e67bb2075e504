"""The worker's hooks on the model: small functions over one state object (as DDP's comm hooks).

* A parameter's post-accumulate-grad hook (:func:`on_grad`) adds its gradient
  to its slot of the flat accumulator and counts it for its group; a complete
  group that syncs in this iteration goes on the comm queue at once and
  backward continues. A group that does not sync (interleave period T > 1)
  takes a local SGD step.
* At the end of backward (:func:`end_of_backward`), groups some of whose
  parameters got no gradient count them as zero, and the iteration is counted.
* A module's forward pre-hook waits on the Futures of the blocks that hold its
  parameters (pulled blocks arrive one by one), not on whole groups. Any other
  read of a parameter whose block is in flight (used before or outside its
  module, or read after backward: ``state_dict()``, an EMA update) waits in
  the parameter itself (:mod:`.guarded`).
* ``.grad`` is this worker's gradient from a forward to the next one
  (:mod:`.grads`).

Everything here runs on the training thread; :class:`HookState` is its state
(the comm thread never writes it).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from imerge.core.backward import Action, BackwardPolicy, Enqueue, LocalStep, Unfinished, WaitAll, WaitPushed
from imerge.core.errors import UnsupportedUse
from imerge.telemetry.timeline import Timeline

from . import clipping, exiting, rounds
from .buffers import FlatParams
from .comm import Communicator
from .config import WorkerConfig
from .grads import LocalGrads
from .groups import GroupRuntime, GroupTable
from .guarded import ParamGuard, guard_params, internal
from .iteration import LoopSettings, LoopState, RoundContext
from .metrics import WorkerMetrics
from .model_buffers import BufferSync
from .optimizer import ShardOptimizer
from .profiler import Profiler
from .waits import Waits


@dataclasses.dataclass(slots=True, eq=False)
class HookState:
    """What the hooks of one engine share. The engine sets ``table`` (a plan switch), ``profiler`` and
    ``after_backward`` (while profiling); the script's settings arrive through ``settings``."""

    config: WorkerConfig
    flat: FlatParams
    comm: Communicator
    optimizer: ShardOptimizer
    metrics: WorkerMetrics
    timeline: Timeline
    buffer_sync: BufferSync
    settings: LoopSettings
    table: GroupTable
    policy: BackwardPolicy  # what each backward does, group by group (the simulator runs the same kernel)
    guard: ParamGuard
    waits: Waits
    loop: LoopState
    grads: LocalGrads
    frozen: dict[str, torch.nn.Parameter]  # the model's parameters outside the layout, by name
    profiler: Profiler | None = None        # while --fusion cost profiles the first iterations
    after_backward: Callable[[], None] | None = None
    loading: bool = False  # imerge.load is loading the module: the state goes to the shards its own way
    root_owned: list[int] = dataclasses.field(default_factory=list)  # the root module's own parameters
    held: list[GroupRuntime] = dataclasses.field(default_factory=list)  # the first round's, until it is decided


def install(state: HookState, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """Install the hooks on ``model`` and guard ``params``; returns what removes them."""
    handles: list[Any] = [p.register_post_accumulate_grad_hook(lambda param: on_grad(state, param))
                          for p in params]
    handles.append(model.register_forward_pre_hook(lambda _module, args: forward_started(state, args),
                                                   prepend=True))
    handles.append(model.register_forward_hook(lambda *_: forward_ended(state)))
    # load_state_dict: in-flight pulls land first, then the loaded parameters go to the shards
    handles.append(model.register_load_state_dict_pre_hook(lambda *_: before_load(state)))
    handles.append(model.register_load_state_dict_post_hook(lambda *_: after_load(state, model, params)))
    for module in model.modules():
        owned = [id(p) for p in module.parameters(recurse=False) if id(p) in state.table.group_of]
        if owned:
            handles.append(module.register_forward_pre_hook(
                lambda _module, _args, owned=owned: module_forward(state, owned)))
        if module is model:
            state.root_owned = owned
    release_guard = guard_params(params, state.guard)

    def remove() -> None:
        for handle in handles:
            handle.remove()
        handles.clear()
        release_guard()

    return remove


# -- forward ----------------------------------------------------------------------------------
@exiting.reaching_the_script
def first_forward(state: HookState, args: tuple[Any, ...]) -> None:
    """The forward during which the job was joined: the root's hooks were installed too late to run for it."""
    forward_started(state, args)
    if state.root_owned:
        module_forward(state, state.root_owned)


@exiting.reaching_the_script
def module_forward(state: HookState, owned: list[int]) -> None:
    state.waits.params(state.table, owned)
    if state.profiler is not None:
        state.profiler.unit_forward([state.table.unit_of[pid] for pid in owned],
                                    time.time() - state.loop.forward_started - state.waits.waited_s)


@exiting.reaching_the_script
def forward_started(state: HookState, args: tuple[Any, ...]) -> None:
    clipping.release(state)  # the held round: the forward needs its result
    state.buffer_sync.apply()
    loop = state.loop
    if torch.is_grad_enabled():  # an evaluation forward is not followed by a backward
        clipping.after_held(state)
        _refuse_unfrozen(state)
        state.comm.staging.before_accumulate()  # the device accumulator's copies to the host are done first
        state.grads.before_forward(state.table.groups, state.comm.staging)
        loop.forward_seen = True
        loop.accumulate = state.settings.accumulating  # as in DDP, the forward decides whether its backward syncs
    now = time.time()
    if loop.forward_started:
        state.metrics.iteration.observe(now - loop.forward_started)
    loop.forward_started, state.waits.waited_s = now, 0.0
    if state.profiler is not None and torch.is_grad_enabled():
        state.profiler.forward_started()
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        state.metrics.samples.inc(args[0].shape[0])


def _refuse_unfrozen(state: HookState) -> None:
    """A parameter frozen when the model was distributed is not in the plan: nobody would train it."""
    for name, param in state.frozen.items():
        if param.requires_grad:
            raise UnsupportedUse(
                f"parameter {name} was frozen (requires_grad False) when the model was distributed and now "
                "requires a gradient: the shards hold only the parameters that were trainable then, so nobody "
                "would train it. Distribute the model with every parameter you will train trainable, and "
                "freeze parameters after imerge.distribute instead (a frozen one is not stepped)")


def forward_ended(state: HookState) -> None:
    if state.profiler is not None:
        state.profiler.forward_ended(time.time() - state.loop.forward_started - state.waits.waited_s)
        state.profiler.backward_started(time.monotonic())


@exiting.reaching_the_script
def grad_ready(state: HookState, param_id: int) -> None:
    """``.grad`` is read: with bucket views it is the slice a push may still be reading; let that finish."""
    group = state.table.group_of.get(param_id)
    if state.grads.bucket_views and group is not None:
        state.waits.pushed(group, "its push to finish before .grad is read")


# -- backward ---------------------------------------------------------------------------------
@exiting.reaching_the_script
def on_grad(state: HookState, param: torch.nn.Parameter) -> None:
    with internal():
        _take_grad(state, param)


def _take_grad(state: HookState, param: torch.nn.Parameter) -> None:
    group = state.table.group_of[id(param)]
    if not state.loop.in_backward:
        _backward_started(state)
    actions = state.policy.gradient(group.index)
    _carry_out(state, [action for action in actions if isinstance(action, WaitPushed)])
    grad = state.grads.take(param, group)
    group.given.add(id(param))
    if state.policy.accumulating:  # no_sync(): summed locally, pushed with the next synced backward
        return
    if any(isinstance(action, LocalStep) for action in actions):  # T > 1: a local SGD step between syncs
        with torch.no_grad():
            param.add_(grad, alpha=-state.optimizer.lr(state.table.param_group[id(param)]))
    if state.profiler is not None:
        state.profiler.unit_progress(state.table.unit_of[id(param)], time.monotonic())
    group.seen.add(id(param))
    if len(group.seen) == len(group.param_ids):
        group.seen.clear()
        _carry_out(state, state.policy.complete(group.index))


def _backward_started(state: HookState) -> None:
    state.loop.backward_starts()
    state.policy.started(state.loop.iteration, state.loop.accumulate)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(state))
    settings = state.settings
    state.loop.round = RoundContext(tuple(state.optimizer.hypers()), settings.loss_scale, settings.max_norm,
                                    settings.clip_value)
    state.loop.holding = clipping.holds(state)
    state.metrics.learning_rates([float(group.get("lr", 0.0)) for group in state.optimizer.param_groups])


def _carry_out(state: HookState, actions: list[Action]) -> None:
    """The backward policy's actions (core/backward.py) on this worker's groups."""
    for action in actions:
        if isinstance(action, WaitAll):
            if not state.loop.holding:  # a held round waits once it leaves (clipping)
                state.waits.all(state.table)
            continue
        group = state.table.groups[action.group]
        if isinstance(action, WaitPushed):
            state.waits.pushed(group, "its previous push to finish")
        elif isinstance(action, Unfinished):  # the gradients that did not come count as zeros
            group.seen.clear()
            rounds.settle_stale(state, group)
            state.grads.none_without_gradient(group)
        elif isinstance(action, Enqueue):
            _send(state, group)


def _send(state: HookState, group: GroupRuntime) -> None:
    """The group's sync goes on the comm queue, or waits for the script's clipping (the first round)."""
    if state.loop.holding:
        state.held.append(group)
    else:
        rounds.enqueue(state, group, state.loop.round)


@exiting.reaching_the_script
def end_of_backward(state: HookState) -> None:
    """Groups some of whose parameters got no gradient count them as zero."""
    with internal():
        _finish_backward(state)


def _finish_backward(state: HookState) -> None:
    loop = state.loop
    actions = state.policy.ended()
    if loop.accumulate:  # a no_sync() micro-batch: not an iteration
        loop.backward_ended(counted=False)
        return
    _carry_out(state, actions)
    _record_iteration(state)
    state.settings.loss_scale = 0.0  # a backward is scaled only if grad_scaler.scale() ran since the last one
    state.buffer_sync.published(loop.iteration)
    loop.backward_ended(counted=True)
    if state.profiler is not None:
        state.profiler.backward_ended()
    if state.after_backward is not None:
        state.after_backward()


def _record_iteration(state: HookState) -> None:
    loop, metrics, ended = state.loop, state.metrics, time.time()
    state.timeline.record(f"iteration {loop.iteration}", "compute", loop.forward_started, ended,
                          iteration=loop.iteration)
    metrics.compute.observe(max(0.0, ended - loop.forward_started - state.waits.waited_s))
    metrics.forward_wait.observe(state.waits.waited_s)
    metrics.iterations.inc()
    metrics.groups_synced.set(loop.groups_enqueued)


# -- load_state_dict ----------------------------------------------------------------------------
@exiting.reaching_the_script
def before_load(state: HookState) -> None:
    clipping.release(state)
    if not state.loading:
        state.waits.all(state.table)
    state.guard.assigning = True


@exiting.reaching_the_script
def after_load(state: HookState, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    state.guard.assigning = False
    current = {id(param) for param in model.parameters()}
    replaced = [state.guard.names[id(param)] for param in params if id(param) not in current]
    if replaced:
        raise UnsupportedUse(f"load_state_dict(assign=True) after imerge.distribute replaced parameter "
                             f"{replaced[0]}: the shards and the hooks hold the old one; load without assign=True")
    if not state.loading:
        rounds.assign(state)
