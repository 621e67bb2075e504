"""The worker's sync engine: gradient hooks, the comm loop, forward waits, the schedule.

* A parameter's post-accumulate-grad hook adds its gradient to its slot of the
  flat accumulator and counts it for its group; a complete group that syncs in
  this iteration goes on the comm queue at once and backward continues. A
  group that does not sync (interleave period T > 1) takes a local SGD step.
* The comm loop (an asyncio loop in its own thread) takes groups off the
  queue (highest priority first), takes the group's slot flag if slots are on,
  pushes the group's blocks (one stream per shard), releases the flag, and
  starts the pull without waiting for it; the pull writes the parameters in
  place and resolves the group's Future, shared by all its members.
* A module's forward pre-hook waits on the Futures of its parameters' groups.
* With ``--fusion cost`` the first iterations are profiled; then the
  coordinator's cost plan regroups the (unchanged) blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import torch

from imerge.errors import IMergeError, RemoteError, WaitTimeout
from imerge.optim import OptimizerSpec
from imerge.planning import BYTES_PER_ELEMENT, Plan
from imerge.schedule import syncs
from imerge.scheduler import CommQueue
from imerge.timeline import Timeline

from .buffers import FlatParams, GroupRuntime
from .config import WorkerConfig
from .metrics import WorkerMetrics
from .profiler import Profiler
from .transport import ShardClient

log = logging.getLogger(__name__)
FENCED_RETRIES = 3  # a push fenced off (its flag's lease had passed) takes the flag again this often


class CommLoop:
    """The worker's comm thread: an asyncio event loop running in a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout_s: float, what: str) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}") from None

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class SyncEngine:
    def __init__(self, model: torch.nn.Module, names: list[str], plan: Plan, config: WorkerConfig,
                 optimizer: OptimizerSpec, store: Any, generation: int = 0):
        self.config = config
        self.generation = generation
        self.optimizer = optimizer.validate()
        self.store = store
        self.timeline = Timeline(config.rank)
        self.metrics = WorkerMetrics(config.rank, config.link_mbps)
        by_name = dict(model.named_parameters())
        self.params = [by_name[n] for n in names]
        self.flat = FlatParams(self.params)
        self.comm = CommLoop(f"imerge-comm-{config.rank}")
        self.clients: list[ShardClient] = self.comm.run(self._connect(plan), 30, "the shard channels to open")
        self.block_rounds = {b.block_id: 0 for b in plan.blocks}
        self._apply_plan(plan)
        self.queue = CommQueue(config.priority)
        self._queued = asyncio.Event()
        self._consumer = self.comm.submit(self._comm_main())
        self._callback_queued = False
        self.iteration = 0          # backwards completed
        self.schedule_start = 0     # the iteration the current plan's schedule counts from
        self._bandwidth_bps = config.slot_bandwidth_mbps * 1e6 / 8
        self._forward_started = 0.0
        self._backward_started = 0.0
        self._waited_s = 0.0        # this iteration's forward waits
        self._groups_enqueued = 0   # this iteration's groups sent
        self.profiler = Profiler(len(plan.units)) if config.fusion == "cost" else None
        self._handles = self._install_hooks(model)

    # -- setup ---------------------------------------------------------------------
    async def _connect(self, plan: Plan) -> list[ShardClient]:
        return [ShardClient(address, self.config) for address in plan.shard_addresses]

    def _apply_plan(self, plan: Plan) -> None:
        """Build the group runtimes and lookup tables of ``plan`` (blocks never change)."""
        self.plan = plan
        self.groups: list[GroupRuntime] = []
        self._group_of: dict[int, GroupRuntime] = {}
        self._unit_of: dict[int, int] = {}
        for group in plan.groups:
            members = {id(p) for p in self.params
                       if group.offset <= self.flat.range[id(p)][0] < group.offset + group.numel}
            blocks = plan.group_blocks(group)
            rounds = {self.block_rounds[b.block_id] for b in blocks}
            if len(rounds) != 1:
                raise IMergeError(f"group {group.index}: its blocks are at different rounds {sorted(rounds)}")
            runtime = GroupRuntime(group, blocks, members, rounds.pop())
            self.groups.append(runtime)
            self._group_of.update({pid: runtime for pid in members})
        for unit in plan.units:
            for p in self.params:
                if unit.offset <= self.flat.range[id(p)][0] < unit.offset + unit.numel:
                    self._unit_of[id(p)] = unit.index

    def _install_hooks(self, model: torch.nn.Module) -> list[Any]:
        handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        handles.append(model.register_forward_pre_hook(lambda _module, args: self._forward_started_now(args),
                                                       prepend=True))
        handles.append(model.register_forward_hook(lambda *_: self._forward_ended_now()))
        for module in model.modules():
            owned = [id(p) for p in module.parameters(recurse=False) if id(p) in self._group_of]
            if owned:
                handles.append(module.register_forward_pre_hook(
                    lambda _module, _args, owned=owned: self._wait_params(owned)))
        return handles

    def initialize(self) -> None:
        """Rank 0 creates every block; then every worker fetches the current parameters."""
        cfg = self.config
        timeout = cfg.rpc_timeout_s * 4
        event = f"blocks-ready:{self.plan.version}"
        if cfg.rank == 0:
            try:
                self.comm.run(self._init_blocks(), timeout, "the shards to accept the initial parameters")
            except Exception as exc:
                self.store.set_event(event, f"worker 0 could not initialize the blocks: {exc}")
                raise
            self.store.set_event(event, "")
        else:
            failure = self.store.wait_event(event, cfg.wait_timeout_s,
                                            "worker 0 to initialize the blocks on the shards")
            if failure:
                raise IMergeError(failure)
        self.comm.run(self._fetch_all(), cfg.wait_timeout_s + 5.0, "the initial parameters from the shards")

    def resume(self, round_: int) -> None:
        """Rejoin a recovered job: fetch the restored parameters (every block at ``round_``) and count
        ``round_`` iterations as done; a cost plan already published is used as is, without profiling."""
        self.comm.run(self._fetch_all(), self.config.wait_timeout_s + 5.0, "the restored parameters from the shards")
        rounds = set(self.block_rounds.values())
        if rounds != {round_}:
            raise IMergeError(f"worker {self.config.rank}: the shards restored rounds {sorted(rounds)}, "
                              f"expected {round_} for every block")
        self.iteration = round_
        if self.profiler is not None and self.plan.version > 1:
            self.profiler = None
            self.schedule_start = self.config.profile_iters

    async def _init_blocks(self) -> None:
        self.flat.stage_to_host()
        await asyncio.gather(*(
            self.clients[b.shard].init_block(b.block_id, self.plan.num_workers, self.optimizer,
                                             self.flat.host_slice(b), self.config.rpc_timeout_s)
            for b in self.plan.blocks))

    async def _fetch_all(self) -> None:
        by_shard: dict[int, list] = {}
        for block in self.plan.blocks:
            by_shard.setdefault(block.shard, []).append(block)
        replies = await asyncio.gather(*(
            self.clients[shard].fetch_into([(b.block_id, self.flat.host_slice(b)) for b in blocks],
                                           self.config.wait_timeout_s, self.generation)
            for shard, blocks in by_shard.items()))
        for blocks, rounds in zip(by_shard.values(), replies):
            self.block_rounds.update({b.block_id: r for b, r in zip(blocks, rounds)})
        self.flat.load_from_host(0, self.flat.values.numel())
        self._apply_plan(self.plan)

    # -- iteration boundaries -------------------------------------------------------------
    def _forward_started_now(self, args: tuple) -> None:
        now = time.time()
        if self._forward_started:
            self.metrics.iteration.observe(now - self._forward_started)
        self._forward_started, self._waited_s = now, 0.0
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self.metrics.samples.inc(args[0].shape[0])

    def _forward_ended_now(self) -> None:
        self._backward_started = time.time()
        if self.profiler is not None:
            self.profiler.backward_started(time.monotonic())

    def _syncs_now(self, group: GroupRuntime) -> bool:
        """Whether ``group`` syncs in this iteration; the profiled iterations of fusion cost sync every one."""
        period = 1 if self.profiler is not None else self.plan.period
        return syncs(group.index, self.iteration - self.schedule_start, period)

    # -- backward: hooks --------------------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        group = self._group_of[id(param)]
        if not group.push_done.is_set():  # two backwards without a forward: let the push finish
            self._wait(group.push_done.wait, group, "its previous push to finish")
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        grad = param.grad.detach()
        self.flat.add_grad(param, grad)
        if not self._syncs_now(group):  # local SGD step between syncs
            with torch.no_grad():
                param.add_(grad, alpha=-self.optimizer.lr)
        param.grad = None
        if self.profiler is not None:
            self.profiler.unit_progress(self._unit_of[id(param)], time.monotonic())
        group.seen.add(id(param))
        if len(group.seen) == len(group.param_ids):
            self._group_complete(group)

    def _group_complete(self, group: GroupRuntime) -> None:
        group.seen.clear()
        group.done_this_backward = True
        if self._syncs_now(group) and self.config.overlap:
            self._enqueue(group)

    def _end_of_backward(self) -> None:
        """Groups some of whose parameters got no gradient count them as zero."""
        for group in self.groups:
            if not group.done_this_backward:
                self._group_complete(group)
            group.done_this_backward = False
            if not self.config.overlap and self._syncs_now(group):
                self._enqueue(group)
        if not self.config.overlap:  # the naive PS: all communication after backward, nothing overlapped
            self.synchronize()
        self._callback_queued = False
        ended = time.time()
        self.timeline.record(f"iteration {self.iteration}", "compute", self._forward_started, ended,
                             iteration=self.iteration)
        self.metrics.compute.observe(max(0.0, ended - self._forward_started - self._waited_s))
        self.metrics.forward_wait.observe(self._waited_s)
        self.metrics.iterations.inc()
        self.metrics.groups_synced.set(self._groups_enqueued)
        self._groups_enqueued = 0
        self.iteration += 1
        if self.profiler is not None:
            self.profiler.backward_ended()
            if self.iteration == self.config.profile_iters:
                self._switch_to_cost_plan()

    def _enqueue(self, group: GroupRuntime) -> None:
        self._groups_enqueued += 1
        group.push_done.clear()
        group.future = concurrent.futures.Future()
        item = (group, group.future, self.iteration - self.schedule_start)
        self.comm.loop.call_soon_threadsafe(self._put, group.index, item)

    def _put(self, index: int, item: Any) -> None:
        self.queue.put(index, item)
        self._queued.set()

    # -- the cost plan -------------------------------------------------------------------------
    def _switch_to_cost_plan(self) -> None:
        """After the profiled iterations: submit the profile (worker 0), adopt the cost plan."""
        self.synchronize()
        if self.config.rank == 0:
            summary = self.profiler.summary([u.numel * BYTES_PER_ELEMENT for u in self.plan.units])
            log.info("profile: alpha %.2e s, beta %.2e s/B, backward %.3f s", summary["alpha_s"],
                     summary["beta_s_per_byte"], summary["ready_s"][-1])
            self.store.submit_profile(json.dumps(summary))
        version = self.plan.version + 1
        payload = self.store.wait_event(f"plan:{version}", self.config.wait_timeout_s,
                                        f"the coordinator's cost plan (v{version})")
        plan = Plan.from_json(payload)
        if plan.blocks != self.plan.blocks:
            raise IMergeError("the cost plan changed the blocks; only the groups may change")
        self._apply_plan(plan)
        self.schedule_start = self.iteration
        self.profiler = None
        log.info("worker %d: cost plan v%d with %d groups from iteration %d", self.config.rank, plan.version,
                 len(plan.groups), self.iteration)

    # -- comm loop ---------------------------------------------------------------------------------
    async def _comm_main(self) -> None:
        while True:
            while not len(self.queue):
                await self._queued.wait()
                self._queued.clear()
            group, future, iteration = self.queue.pop()
            if group is None:
                return
            try:
                if group.pull_task is not None:
                    await asyncio.wait([group.pull_task])
                await self._push_group(group, iteration)
            except Exception as exc:  # routed to whoever waits on the group
                future.set_exception(exc)
                continue
            finally:
                group.push_done.set()
            group.pull_task = asyncio.get_running_loop().create_task(self._pull_group(group, future))

    async def _push_group(self, group: GroupRuntime, iteration: int) -> None:
        for attempt in range(FENCED_RETRIES + 1):
            try:
                await self._push_group_once(group, iteration)
                break
            except RemoteError as exc:  # ABORTED: fenced off, our flag's lease had passed to another
                if exc.status != "ABORTED" or attempt == FENCED_RETRIES:
                    raise
                log.warning("worker %d: %s; taking the flag again", self.config.rank, exc)
        self.flat.grads[group.group.offset:group.group.offset + group.group.numel].zero_()

    async def _push_group_once(self, group: GroupRuntime, iteration: int) -> None:
        cfg = self.config
        flag, token = f"{self.plan.version}:{group.index}", f"w{cfg.rank}:{uuid.uuid4().hex[:8]}"
        fence = 0
        if cfg.slots != "off":
            with self.timeline.span(f"flag {group.index}", "flag-wait", group=group.index) as args, \
                    self.metrics.flag_wait.time():
                args["contended"], fence = await asyncio.to_thread(
                    self.store.acquire_flag, flag, token, cfg.flag_lease_s, cfg.pull_timeout_s, self.generation)
        acquired = time.monotonic()
        try:
            with self.timeline.span(f"push {group.index}", "push", group=group.index, iteration=iteration,
                                    round=group.round, bytes=group.nbytes):
                await asyncio.gather(*(self._push_shard(group, shard, blocks, fence)
                                       for shard, blocks in group.by_shard.items()))
            if cfg.slots == "fixed" and self._bandwidth_bps > 0:
                await asyncio.sleep(max(0.0, acquired + group.nbytes / self._bandwidth_bps - time.monotonic()))
        finally:
            if cfg.slots != "off":
                self.metrics.flag_held(group.index, time.monotonic() - acquired)
            if cfg.slots != "off" and not await asyncio.to_thread(self.store.release_flag, flag, token):
                log.warning("worker %d: slot flag %s had passed to another holder (lease %.1fs)",
                            cfg.rank, flag, cfg.flag_lease_s)

    async def _push_shard(self, group: GroupRuntime, shard: int, blocks: list, fence: int) -> None:
        started = time.monotonic()
        await self.clients[shard].push([(b.block_id, self.flat.grad_slice(b)) for b in blocks],
                                       self.config.rank, group.round, self.config.rpc_timeout_s,
                                       self.generation, fence)
        seconds = time.monotonic() - started
        nbytes = sum(b.numel for b in blocks) * BYTES_PER_ELEMENT
        self.metrics.pushed(shard, nbytes)
        if self.profiler is not None:
            self.profiler.push(nbytes, seconds)
        if self.config.slot_bandwidth_mbps == 0 and seconds > 0:  # moving average of observed pushes
            observed = nbytes / seconds
            self._bandwidth_bps = observed if self._bandwidth_bps == 0 else 0.8 * self._bandwidth_bps + 0.2 * observed

    async def _pull_group(self, group: GroupRuntime, future: concurrent.futures.Future) -> None:
        try:
            with self.timeline.span(f"pull {group.index}", "pull", group=group.index, round=group.round):
                replies = await asyncio.gather(*(
                    self.clients[shard].pull_into([(b.block_id, self.flat.host_slice(b)) for b in blocks],
                                                  self.config.rank, group.round, self.config.pull_timeout_s,
                                                  self.generation)
                    for shard, blocks in group.by_shard.items()))
            rounds = {r for reply in replies for r in reply}
            if rounds != {group.round + 1}:
                raise IMergeError(f"{group}: expected round {group.round + 1}, shards answered {sorted(rounds)}")
            self.flat.load_from_host(group.group.offset, group.group.numel)
            for shard, blocks in group.by_shard.items():
                self.metrics.pulled(shard, sum(b.numel for b in blocks) * BYTES_PER_ELEMENT)
            self.metrics.group_synced(group.group.index)
            group.round += 1
            self.block_rounds.update({b.block_id: group.round for b in group.blocks})
            future.set_result(group.round)
        except Exception as exc:
            future.set_exception(exc)

    # -- forward: waits ----------------------------------------------------------------------------
    def _wait(self, wait: Any, group: GroupRuntime, what: str) -> Any:
        timeout = self.config.pull_timeout_s + self.config.rpc_timeout_s + self.config.flag_lease_s + 10.0
        started = time.monotonic()
        try:
            result = wait(timeout)
        except concurrent.futures.TimeoutError:
            result = False
        if result is False:
            raise WaitTimeout(f"worker {self.config.rank}: timed out after {time.monotonic() - started:.1f}s "
                              f"waiting for {group} {what}")
        return result

    def _wait_groups(self, groups: list[GroupRuntime]) -> None:
        for group in groups:
            future = group.future
            if future is None:
                continue
            if not future.done():
                started = time.time()
                with self.timeline.span(f"wait {group.index}", "forward-wait", group=group.index):
                    self._wait(future.result, group, f"round {group.round + 1} to be pulled")
                self._waited_s += time.time() - started
            future.result()  # re-raise a failed sync

    def _wait_params(self, param_ids: list[int]) -> None:
        groups = {id(self._group_of[p]): self._group_of[p] for p in param_ids}
        self._wait_groups(sorted(groups.values(), key=lambda g: g.index))

    def synchronize(self) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        self._wait_groups(self.groups)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.config.trace_dir:
            log.info("timeline written to %s", self.timeline.write(self.config.trace_dir))
        if self.comm.loop.is_running():
            self.comm.loop.call_soon_threadsafe(self._put, 1 << 30, (None, None, 0))
            try:
                self._consumer.result(10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.comm.run(self._close_clients(), 10, "the shard channels to close")
        self.comm.close()

    async def _close_clients(self) -> None:
        for group in self.groups:
            if group.pull_task is not None and not group.pull_task.done():
                group.pull_task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
