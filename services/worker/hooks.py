"""The worker's hooks on the model, and the iterations they count.

* A parameter's post-accumulate-grad hook adds its gradient to its slot of the
  flat accumulator and counts it for its group; a complete group that syncs in
  this iteration goes on the comm queue at once and backward continues. A
  group that does not sync (interleave period T > 1) takes a local SGD step.
* At the end of backward, groups some of whose parameters got no gradient
  count them as zero, and the iteration is counted.
* A module's forward pre-hook waits on the Futures of the blocks that hold its
  parameters (pulled blocks arrive one by one), not on whole groups. Any other
  read of a parameter whose block is in flight (used before or outside its
  module, or read after backward: ``state_dict()``, an EMA update) waits in
  the parameter itself (:mod:`.guarded`).
* ``.grad`` is this worker's gradient from a forward to the next one
  (:mod:`.grads`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from imerge.core.errors import UnsupportedUse, WaitTimeout
from imerge.core.schedule import syncs
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams, GroupRuntime, GroupTable
from .comm import Communicator, RoundResult
from .staging import DONE
from .config import WorkerConfig
from .grads import LocalGrads
from .guarded import ParamGuard, guard_params, internal
from .metrics import WorkerMetrics
from .model_buffers import BufferSync
from .items import PushOptions
from .optimizer import ShardOptimizer
from .profiler import Profiler


class Hooks:
    def __init__(self, flat: FlatParams, comm: Communicator, config: WorkerConfig, optimizer: ShardOptimizer,
                 metrics: WorkerMetrics, timeline: Timeline, names: dict[int, str]):
        self.flat, self.comm, self.config, self.optimizer = flat, comm, config, optimizer
        self.names = names          # id(param) -> its qualified name, for messages
        self.metrics, self.timeline = metrics, timeline
        self.table: GroupTable | None = None  # the current plan's groups
        self.profiler: Profiler | None = None  # while --fusion cost profiles the first iterations
        self.after_backward: Callable[[], None] | None = None
        self.iteration = 0          # backwards completed
        self.schedule_start = 0     # the iteration the current plan's schedule counts from
        self._handles: list[Any] = []
        self._callback_queued = False
        self._forward_started = 0.0
        self._forward_seen = False  # a forward ran since the last backward ended
        self._waited_s = 0.0        # this iteration's forward waits
        self.grads: LocalGrads | None = None  # each parameter's .grad (set by install)
        self._params: list[torch.nn.Parameter] = []
        self.model: torch.nn.Module | None = None
        self._root_owned: list[int] = []  # the root module's own parameters
        self.frozen: dict[str, torch.nn.Parameter] = {}  # the model's parameters outside the layout, by name
        self.guard = ParamGuard(names, self.wait_params, self._grad_ready)
        self.in_flight = self.guard.in_flight  # groups whose latest sync this thread has not waited for yet
        self._release_guard: Callable[[], None] | None = None
        self.round_hypers: list[str] = []  # each param group's hyperparameters, as this backward's pushes carry
        self.buffer_sync: BufferSync | None = None  # set by the engine
        self.accumulating = False   # inside model.no_sync()
        self.loss_scale = 0.0       # the grad scaler's scale of the coming backward (0: none)
        self._loading = False       # imerge.load is loading the module: the state goes to the shards its own way
        self.max_norm = 0.0         # clip every round's averaged gradient to this norm (0: no clipping)
        self._round_scaling = (0.0, 0.0)  # (loss scale, max norm) of this backward's pushes
        self._accumulate_this = False  # the last forward ran inside no_sync(): its backward only accumulates
        self._groups_enqueued = 0   # this iteration's groups sent
        self._script_steps = False  # the loop calls optimizer.step(): then each synced backward needs one
        self._backwards_since_step = 0
        self.wait_timeout_s = config.pull_timeout_s + config.rpc_timeout_s + config.flag_lease_s + 10.0

    def install(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        # T = 1: every .grad is a view of the accumulator, so autograd adds into it in place (with T > 1 a local
        # step needs each iteration's own gradient)
        self._params, self.model = list(params), model
        self.grads = LocalGrads(self.flat, self._params, bucket_views=self.table.plan.period == 1)
        trained = {id(p) for p in params}
        self.frozen = {name: p for name, p in model.named_parameters() if id(p) not in trained}
        handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        handles.append(model.register_forward_pre_hook(lambda _module, args: self._forward_started_now(args),
                                                       prepend=True))
        handles.append(model.register_forward_hook(lambda *_: self._forward_ended_now()))
        # load_state_dict: in-flight pulls land first, then the loaded parameters go to the shards
        handles.append(model.register_load_state_dict_pre_hook(lambda *_: self._before_load()))
        handles.append(model.register_load_state_dict_post_hook(lambda *_: self._after_load()))
        for module in model.modules():
            owned = [id(p) for p in module.parameters(recurse=False) if id(p) in self.table.group_of]
            if owned:
                handles.append(module.register_forward_pre_hook(
                    lambda _module, _args, owned=owned: self._module_forward(owned)))
            if module is model:
                self._root_owned = owned
        self._handles = handles
        self._release_guard = guard_params(self._params, self.guard)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._release_guard is not None:
            self._release_guard()
            self._release_guard = None

    # -- iteration boundaries -------------------------------------------------------------
    def first_forward(self, args: tuple) -> None:
        """The forward during which the job was joined: the root's hooks were installed too late to run for it."""
        self._forward_started_now(args)
        if self._root_owned:
            self._module_forward(self._root_owned)

    def _module_forward(self, owned: list[int]) -> None:
        self.wait_params(owned)
        if self.profiler is not None:
            self.profiler.unit_forward([self.table.unit_of[pid] for pid in owned],
                                       time.time() - self._forward_started - self._waited_s)

    def _forward_started_now(self, args: tuple) -> None:
        self.buffer_sync.apply()
        if torch.is_grad_enabled():  # an evaluation forward is not followed by a backward
            self._refuse_unfrozen()
            self.comm.staging.before_accumulate()  # the device accumulator's copies to the host are done first
            self.grads.before_forward(self.table.groups, self.comm.staging)
            self._forward_seen = True
            self._accumulate_this = self.accumulating  # as in DDP, the forward decides whether its backward syncs
        now = time.time()
        if self._forward_started:
            self.metrics.iteration.observe(now - self._forward_started)
        self._forward_started, self._waited_s = now, 0.0
        if self.profiler is not None and torch.is_grad_enabled():
            self.profiler.forward_started()
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self.metrics.samples.inc(args[0].shape[0])

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen when the model was distributed is not in the plan: nobody would train it."""
        for name, param in self.frozen.items():
            if param.requires_grad:
                raise UnsupportedUse(
                    f"parameter {name} was frozen (requires_grad False) when the model was distributed and now "
                    "requires a gradient: the shards hold only the parameters that were trainable then, so nobody "
                    "would train it. Distribute the model with every parameter you will train trainable, and "
                    "freeze parameters after imerge.distribute instead (a frozen one is not stepped)")

    def _grad_ready(self, param_id: int) -> None:
        """``.grad`` is read: with bucket views it is the slice a push may still be reading; let that finish."""
        group = self.table.group_of.get(param_id)
        if self.grads.bucket_views and group is not None and not group.push_done.is_set():
            self._wait(group.push_done.wait, group, "its push to finish before .grad is read")

    def _forward_ended_now(self) -> None:
        if self.profiler is not None:
            self.profiler.forward_ended(time.time() - self._forward_started - self._waited_s)
            self.profiler.backward_started(time.monotonic())

    def syncs_now(self, group: GroupRuntime) -> bool:
        """Whether ``group`` syncs in this iteration; the profiled iterations of fusion cost sync every one."""
        period = 1 if self.profiler is not None and self.profiler.plans else self.table.plan.period
        return syncs(group.index, self.iteration - self.schedule_start, period)

    # -- backward ---------------------------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        with internal():
            self._take_grad(param)

    def _take_grad(self, param: torch.nn.Parameter) -> None:
        group = self.table.group_of[id(param)]
        if not self._callback_queued:
            self._backward_started()
        if not group.push_done.is_set():  # the previous push of this group is still going out
            self._wait(group.push_done.wait, group, "its previous push to finish")
        grad = self.grads.take(param, group)
        group.given.add(id(param))
        if self._accumulate_this:  # no_sync(): summed locally, pushed with the next synced backward
            return
        if not self.syncs_now(group):  # local SGD step between syncs
            with torch.no_grad():
                param.add_(grad, alpha=-self.optimizer.lr(self.table.param_group[id(param)]))
        if self.profiler is not None:
            self.profiler.unit_progress(self.table.unit_of[id(param)], time.monotonic())
        group.seen.add(id(param))
        if len(group.seen) == len(group.param_ids):
            self._group_complete(group)

    def _backward_started(self) -> None:
        if not self._forward_seen and self.iteration > 0 and not self._accumulate_this:
            raise UnsupportedUse(
                f"worker {self.config.rank}: a second backward after iteration {self.iteration} without a forward "
                "of the wrapped model in between: every backward is one optimizer step on the shards, so it would "
                "step twice (or, on one rank only, desynchronize the job); run the wrapped model's forward before "
                "each backward, or accumulate gradients under model.no_sync()")
        if self._script_steps and self._backwards_since_step and not self._accumulate_this:
            raise UnsupportedUse(
                f"worker {self.config.rank}: a second backward since the last optimizer.step(): with IMerge every "
                "backward is an optimizer step on the shards, so accumulating gradients over several backward "
                "passes before one step (as DDP allows) would take a step per backward. Accumulate under "
                "model.no_sync() (or model.require_backward_grad_sync = False) for every backward but the last")
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._callback_queued = True
        self.round_hypers = self.optimizer.hypers()
        self.metrics.learning_rates([float(group.get("lr", 0.0)) for group in self.optimizer.param_groups])
        self._round_scaling = (self.loss_scale, self.max_norm)

    def _group_complete(self, group: GroupRuntime) -> None:
        group.seen.clear()
        group.done_this_backward = True
        if self.syncs_now(group) and self.config.overlap:
            self._enqueue(group)

    def _enqueue(self, group: GroupRuntime, assign: bool = False) -> None:
        """Queue the group's sync; each block's push carries the round's hyperparameters of its parameter group
        and the pieces of it that got no gradient since the last sync (counted as zeros; one that no worker gave
        a gradient is not stepped, as in torch.optim). ``assign``: the data are parameters to assign."""
        self._groups_enqueued += 1
        units = self.table.plan.units
        loss_scale, max_norm = (0.0, 0.0) if assign else self._round_scaling
        options = {b.block_id: PushOptions(self.round_hypers[units[b.unit].group],
                                           tuple(i for i, pid in enumerate(self.table.pieces_of[b.block_id])
                                                 if pid not in group.given), assign, loss_scale, max_norm)
                   for b in group.blocks}
        group.given.clear()
        ready = self.comm.staging.group_complete(group.group.offset, group.group.numel)  # returns at once
        self.comm.enqueue(group, self.iteration - self.schedule_start, options, ready)
        group.unsettled = {b.block_id for b in group.blocks}
        group.dirty = True
        self.in_flight.add(group.index)

    def _end_of_backward(self) -> None:
        """Groups some of whose parameters got no gradient count them as zero."""
        with internal():
            self._finish_backward()

    def _finish_backward(self) -> None:
        if self._accumulate_this:  # a no_sync() micro-batch: not an iteration
            self._backward_done()
            return
        for group in self.table.groups:
            if not group.done_this_backward:
                if group.dirty:  # none of its parameters got a gradient: its slice still holds the last push
                    self._wait(group.push_done.wait, group, "its previous push to finish")
                    self.grads.clear(group)
                self.grads.none_without_gradient(group)
                self._group_complete(group)
            group.done_this_backward = False
            if not self.config.overlap and self.syncs_now(group):
                self._enqueue(group)
        if not self.config.overlap:  # the naive PS: all communication after backward, nothing overlapped
            self.synchronize()
        self._backward_done()
        ended = time.time()
        self.timeline.record(f"iteration {self.iteration}", "compute", self._forward_started, ended,
                             iteration=self.iteration)
        self.metrics.compute.observe(max(0.0, ended - self._forward_started - self._waited_s))
        self.metrics.forward_wait.observe(self._waited_s)
        self.metrics.iterations.inc()
        self.metrics.groups_synced.set(self._groups_enqueued)
        self._groups_enqueued = 0
        self.loss_scale = 0.0  # a backward is scaled only if grad_scaler.scale() ran since the last one
        self.buffer_sync.published(self.iteration)
        self.iteration += 1
        self._backwards_since_step += 1
        if self.profiler is not None:
            self.profiler.backward_ended()
        if self.after_backward is not None:
            self.after_backward()

    def _backward_done(self) -> None:
        self._callback_queued = False
        self._forward_seen = False

    def stepped(self) -> None:
        """The loop called optimizer.step(): after more than one synced backward since the last, that step stands
        for several shard steps (DDP-style accumulation without no_sync)."""
        if self._backwards_since_step > 1:
            self._backwards_since_step = 0
            raise UnsupportedUse(
                f"worker {self.config.rank}: optimizer.step() after several backward passes: with IMerge every "
                "backward is an optimizer step on the shards, so gradients accumulated over several backward passes "
                "were stepped once each. Accumulate under model.no_sync() (or model.require_backward_grad_sync = "
                "False) for every backward but the last")
        self._script_steps = True
        self._backwards_since_step = 0

    # -- forward: waits ----------------------------------------------------------------------------
    def _wait(self, wait: Any, group: GroupRuntime, what: str) -> Any:
        started = time.monotonic()
        try:
            result = wait(self.wait_timeout_s)
        except concurrent.futures.TimeoutError:
            result = False
        if result is False:
            raise WaitTimeout(f"worker {self.config.rank}: timed out after {time.monotonic() - started:.1f}s "
                              f"waiting for {group} {what}")
        return result

    def _wait_futures(self, group: GroupRuntime, futures: list[concurrent.futures.Future], what: str,
                      block_ids: list[str] | None = None) -> None:
        """Wait for these futures of the group; the forward's stream then waits for the copies back of the
        blocks it needs (``block_ids``; all of the group's when None)."""
        if not all(f.done() for f in futures):
            started = time.time()
            with self.timeline.span(f"wait {group.index}", "forward-wait", group=group.index):
                for future in futures:
                    self._wait(future.result, group, what)
            self._waited_s += time.time() - started
        for future in futures:
            future.result()  # re-raise a failed sync
        block_ids = block_ids if block_ids is not None else [block.block_id for block in group.blocks]
        for block_id in block_ids:
            self.comm.staging.before_use(self.comm.arrived.get(block_id, DONE))
        group.unsettled.difference_update(block_ids)
        if not group.unsettled:
            self.in_flight.discard(group.index)

    def wait_params(self, param_ids: list[int]) -> None:
        """Wait until the blocks holding these parameters are back from their latest sync."""
        if not self.in_flight:
            return
        needed: dict[int, tuple[GroupRuntime, set[str]]] = {}
        for pid in param_ids:
            group = self.table.group_of.get(pid)
            if group is None or group.index not in self.in_flight:
                continue
            pending = group.unsettled.intersection(self.table.blocks_of[pid])
            if pending:
                needed.setdefault(group.index, (group, set()))[1].update(pending)
        for index in sorted(needed):
            group, block_ids = needed[index]
            waited = sorted(block_ids)
            self._wait_futures(group, [group.block_futures[b] for b in waited],
                               f"round {group.round + 1} of blocks {waited} to be pulled", waited)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        self._loading = True
        try:
            yield
        finally:
            self._loading = False

    @property
    def started(self) -> bool:
        """Whether this engine pushed (or is pushing) a round already."""
        return self.iteration > 0 or self._callback_queued

    def last_round_result(self) -> RoundResult | None:
        """What the shards said of the latest round pushed (waiting for its first block to come back)."""
        group = self.table.groups[-1]  # the first layers: the group the next forward needs first
        if group.future is None:
            return None
        block_id = group.blocks[0].block_id
        round_ = self._wait(group.block_futures[block_id].result, group,
                            f"round {group.round + 1} of block {block_id} to be pulled")
        return self.comm.round_results.get(round_)

    def flush(self) -> None:
        """With T > 1, sync every group that did not sync in the last iteration (it holds local SGD steps and
        the sum of its gradients since its last sync), so that every worker ends with the shards' parameters."""
        if self.table.plan.period == 1 or self.iteration == self.schedule_start:
            return
        self.round_hypers = self.optimizer.hypers()
        for group in self.table.groups:
            if not syncs(group.index, self.iteration - 1 - self.schedule_start, self.table.plan.period):
                if not group.push_done.is_set():
                    self._wait(group.push_done.wait, group, "its previous push to finish")
                self._enqueue(group)
        self.synchronize()

    def _before_load(self) -> None:
        if not self._loading:
            self.synchronize()
        self.guard.assigning = True

    def _after_load(self) -> None:
        self.guard.assigning = False
        current = {id(param) for param in self.model.parameters()}
        replaced = [self.names[id(param)] for param in self._params if id(param) not in current]
        if replaced:
            raise UnsupportedUse(f"load_state_dict(assign=True) after imerge.distribute replaced parameter "
                                 f"{replaced[0]}: the shards and the hooks hold the old one; load without assign=True")
        if not self._loading:
            self.assign()

    def assign(self) -> None:
        """Send this worker's parameters to the shards as a round of their own: the shards take worker 0's (every
        worker takes part, at the same point of its loop) and every worker pulls them."""
        if any(group.given for group in self.table.groups):
            raise UnsupportedUse("load_state_dict() inside a gradient accumulation (no_sync): the accumulated "
                                 "gradients would be lost; load before the micro-batches or after their step")
        self.synchronize()
        self.round_hypers = self.optimizer.hypers()
        self.settle_accumulator()
        self.flat.grads.copy_(self.flat.values)
        for group in self.table.groups:
            self._enqueue(group, assign=True)
        self.synchronize()

    def settle_accumulator(self) -> None:
        """Every push out and every pushed slice of the accumulator zeroed (before the groups change, or the
        accumulator is used for anything else)."""
        self.comm.staging.before_accumulate()
        for group in self.table.groups:
            if not group.push_done.is_set():
                self._wait(group.push_done.wait, group, "its push to finish")
            if group.dirty:
                self.grads.clear(group)

    def synchronize(self) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        for group in self.table.groups:
            if group.future is not None:
                self._wait_futures(group, [group.future], f"round {group.round + 1} to be pulled")
