"""The worker's sync engine: wires the flat buffers, the hooks and the comm loop to one plan.

* :mod:`.buffers`: every parameter is a view into one flat tensor; the group
  runtimes of the current plan (:class:`GroupTable`).
* :mod:`.hooks`: the gradient hooks and forward waits, functions over one
  :class:`~.hooks.HookState`; :mod:`.iteration`: the loop's settings, each
  backward's round context, the sync schedule, the iteration count;
  :mod:`.waits`: the training thread's bounded waits; :mod:`.rounds`: the
  rounds it sends.
* :mod:`.comm`: the comm thread: queue, pulls, the groups' Futures; pushes
  under the slot policy (:mod:`.pushes`, :mod:`imerge.core.slots`).
* :mod:`.profiler`: with ``--fusion cost`` the first iterations are profiled;
  then the coordinator's cost plan regroups the (unchanged) blocks.

The engine itself creates the blocks on the shards (rank 0), fetches the
parameters (at start and when rejoining a recovered job) and switches plans;
the API calls its methods, never the hooks' state.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from imerge.control.messages import BlocksReady
from imerge.control.store import WorkerStore
from imerge.core.backward import BackwardPolicy
from imerge.core.errors import IMergeError, JobFailed
from imerge.core.knobs import apply, describe
from imerge.core.planning import COST_PLAN, Plan
from imerge.core.schedule import SyncSchedule
from imerge.telemetry import progress
from imerge.telemetry.timeline import Timeline

from . import clipping, hooks, rounds
from .buffers import FlatParams
from .comm import CommLoop, open_comm, slot_policy
from .config import WorkerConfig
from .grads import LocalGrads
from .groups import GroupRuntime, GroupTable, RoundResult
from .guarded import ParamGuard
from .iteration import LoopSettings, LoopState
from .metrics import WorkerMetrics
from .model_buffers import BufferSync
from .optimizer import ShardOptimizer
from .profiler import Profiler, cost_plan
from .retuning import Retuning
from . import saving
from .saving import block_states, check_optimizer_state
from .shard_blocks import ShardBlocks
from .waits import Waits

log = logging.getLogger(__name__)
JOIN_STATE = -1  # the tag of worker 0's module state shared when the job is joined (imerge.load #n: -1 - n)


class SyncEngine:
    def __init__(self, model: torch.nn.Module, names: list[str], plan: Plan, config: WorkerConfig,
                 optimizer: ShardOptimizer, store: WorkerStore, generation: int = 0,
                 settings: LoopSettings | None = None):
        self.config = config
        self.generation = generation
        self.optimizer = optimizer
        self._loads = 0  # imerge.load calls: each is one barrier between worker 0 and the others
        self.store = store
        self.timeline = Timeline(config.rank)
        self.metrics = WorkerMetrics(config.rank, config.link_mbps)
        by_name = dict(model.named_parameters())
        self.params = [by_name[n] for n in names]
        self.names = {id(by_name[n]): n for n in names}  # id(param) -> its qualified name, for messages
        self.flat = FlatParams(self.params)
        self.loop = CommLoop(f"imerge-comm-{config.rank}", config.thread_policy)
        self.comm = open_comm(self.loop, config, plan, store, self.flat, self.metrics, self.timeline, generation)
        self.blocks = ShardBlocks(self.comm.clients, self.flat, self.comm.compression, config.rpc_timeout_s,
                                  config.wait_timeout_s, generation)
        self.state = self._hook_state(model, plan, store, settings or LoopSettings())
        optimizer.on_step = self.stepped
        optimizer.state_source = lambda: saving.optimizer_state(self)
        optimizer.round_result = self.last_round_result
        self.retuning: Retuning | None = None  # online re-tuning, from --tune's plan switch on
        switches = config.plan_options().switches
        if switches or (config.profile_out and config.rank == 0):
            self._start_profiling(switches)
        self._remove_hooks = hooks.install(self.state, model, self.params)

    def _hook_state(self, model: torch.nn.Module, plan: Plan, store: WorkerStore,
                    settings: LoopSettings) -> hooks.HookState:
        config = self.config
        table = GroupTable(plan, self.flat, self.params, {b.block_id: 0 for b in plan.blocks})
        self.comm.plan_version = plan.version
        guard = ParamGuard(self.names, lambda ids: self.state.waits.params(self.state.table, ids),
                           lambda param_id: hooks.grad_ready(self.state, param_id))
        wait_timeout_s = config.pull_timeout_s + config.rpc_timeout_s + config.flag_lease_s + 10.0
        buffer_sync = BufferSync(model, store, rank=config.rank, world_size=config.world_size, mode=config.buffers,
                                 generation=self.generation, timeout_s=config.pull_timeout_s + config.rpc_timeout_s)
        trained = {id(p) for p in self.params}
        # T = 1: every .grad is a view of the accumulator, so autograd adds into it in place (with T > 1 a local
        # step needs each iteration's own gradient)
        return hooks.HookState(
            config, self.flat, self.comm, self.optimizer, self.metrics, self.timeline, buffer_sync, settings, table,
            BackwardPolicy(len(plan.groups), config.overlap, SyncSchedule(plan.period)), guard, Waits(config.rank, wait_timeout_s, self.comm, self.timeline,
                                                    guard.in_flight),
            LoopState(config.rank), LocalGrads(self.flat, self.params, bucket_views=plan.period == 1),
            {name: p for name, p in model.named_parameters() if id(p) not in trained})

    # -- plans ---------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self.state.table.plan

    @property
    def iteration(self) -> int:
        return self.state.loop.iteration

    @property
    def groups(self) -> list[GroupRuntime]:
        return self.state.table.groups

    @property
    def settings(self) -> LoopSettings:
        """What the loop sets for its coming backward passes (clipping, no_sync, the loss scale)."""
        return self.state.settings

    @property
    def started(self) -> bool:
        """Whether this engine pushed (or is pushing) a round already."""
        return self.state.loop.started

    def block_rounds(self) -> dict[str, int]:
        return self.state.table.block_rounds()

    def use_plan(self, plan: Plan, block_rounds: dict[str, int]) -> None:
        """Group the (unchanging) blocks as ``plan`` says, each group at its blocks' round."""
        rounds.settle_accumulator(self.state)
        self.state.table = GroupTable(plan, self.flat, self.params, block_rounds).handed_over(self.state.table)
        self.state.policy.regrouped(len(plan.groups))
        self.comm.plan_version = plan.version

    def _start_profiling(self, switches: bool) -> None:
        """Profile the first iterations: for the plan switch (``switches``: --fusion cost, --tune) or only for
        --profile-out. Fusion cost's profiled iterations sync every group, whatever T (its cost model prices every
        group's push); --tune's keep the job's schedule, so that tuning never changes the result."""
        self.state.profiler = Profiler(len(self.plan.units), plans=switches)
        self.state.policy.profiling(switches and self.config.fusion == "cost")
        if switches and self.config.rank == 0 and progress.connected():  # imerge launch's line says so
            progress.report("stage", stage="profiling", until=self.config.profile_iters)
        self.comm.on_push = self.state.profiler.push
        self.state.after_backward = self._after_profiled_backward

    def _stop_profiling(self, schedule_start: int | None = None) -> None:
        """Profiling is over; where the profiled iterations synced every group, the schedule counts from
        ``schedule_start``."""
        self.state.profiler = None
        policy = self.state.policy
        if schedule_start is not None and policy.schedule.profiling:
            policy.restart(schedule_start, self.plan.period)
        if policy.schedule.profiling:
            policy.profiling(False)
        self.comm.on_push = None
        self.state.after_backward = None

    def _after_profiled_backward(self) -> None:
        profiler = self.state.profiler
        if self.iteration != self.config.profile_iters or profiler is None:
            return
        if self.config.profile_out and self.config.rank == 0:
            profiler.write(self.config.profile_out, self.plan)
        if not profiler.plans:
            self._stop_profiling()
            return
        self.synchronize()
        plan = cost_plan(self.store, profiler, self.plan, self.config.rank,
                         self.config.wait_timeout_s, self.comm.compression.estimate, self.generation)
        self._switch(plan, "chosen by --tune" if plan.knobs else "fusion cost", profiler.compute_s())
        self._stop_profiling(schedule_start=self.iteration)
        if self.config.rank == 0 and progress.connected():
            progress.report("stage", stage="training")
        self._start_retuning()

    def _switch(self, plan: Plan, why: str, profile_compute_s: float = 0.0) -> None:
        """After this iteration's backward: every group's latest sync done, then ``plan``'s groups and knobs; worker
        0 reports a tuned plan (imerge launch prints it, imerge bench records it), with the compute per iteration
        of the profile it was decided on (``profile_compute_s``; 0: a re-tuned plan, decided on a window)."""
        if plan.blocks != self.plan.blocks:
            raise IMergeError(f"plan v{plan.version} changed the blocks; only the groups may change")
        self.synchronize()
        self.use_plan(plan, self.block_rounds())
        if plan.knobs:
            self._use_knobs(plan)
        log.info("worker %d: plan v%d with %d groups from iteration %d (%s%s)", self.config.rank, plan.version,
                 len(plan.groups), self.iteration + 1, f"{describe(plan.knobs)}, " if plan.knobs else "", why)
        if plan.predicted_s and self.config.rank == 0:
            progress.report("schedule", iteration=self.iteration, plan=plan.version, knobs=dict(plan.knobs),
                            predicted_s=plan.predicted_s, runner_up=dict(plan.runner_up),
                            runner_up_s=plan.runner_up_s, profile_compute_s=profile_compute_s)

    # -- online re-tuning ------------------------------------------------------------------------
    def _start_retuning(self) -> None:
        """After --tune's plan switch: look at the plans at each window boundary (worker 0: and measure each
        window), and switch where a re-tuned plan says."""
        window = self.config.plan_options().retune_window
        if not (window and self.plan.knobs) or self.retuning is not None:
            return
        self.retuning = Retuning(self.store, self.config.rank, window, self.plan.version)
        self.comm.on_push = self.retuning.meter.push if self.retuning.meter else None
        self.state.after_backward = self._after_window_backward

    def _after_window_backward(self) -> None:
        assert self.retuning is not None
        plan = self.retuning.after_backward(self.iteration, self.generation, self.plan.version,
                                            self.state.waits.waited_s)
        if plan is not None:
            self._switch(plan, "re-tuned online")

    def _use_knobs(self, plan: Plan) -> None:
        """Push as the knobs --tune chose say (priority, slot policy) from now on."""
        chosen = apply(self.config, plan.knobs)
        slots, width = slot_policy(chosen, plan, self.store, self.generation)
        self.comm.use_schedule(chosen.priority, slots, chosen.slot_scope, width)

    # -- the blocks on the shards ------------------------------------------------------------
    def initialize(self, optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Rank 0 creates every block (with ``optimizer_state``, per parameter: a torch optimizer's loaded state);
        then every worker fetches the current parameters."""
        cfg = self.config
        if cfg.rank == 0:
            try:
                self.loop.run(self.blocks.create(self.plan, self.optimizer.spec), cfg.rpc_timeout_s * 4,
                              "the shards to accept the initial parameters")
                if optimizer_state:
                    check_optimizer_state(self, optimizer_state, "the optimizer's loaded state")
                    self.load_states(block_states(self, optimizer_state), cfg.rpc_timeout_s * 4,
                                     "the shards to import the optimizer's loaded state")
            except Exception as exc:
                self.store.announce_blocks_ready(self.plan.version, BlocksReady(
                    f"worker 0 could not initialize the blocks: {exc}"))
                raise
            self.store.announce_blocks_ready(self.plan.version, BlocksReady())
        else:
            ready = self.store.wait_blocks_ready(self.plan.version, cfg.wait_timeout_s)
            if ready.error:
                raise JobFailed(ready.error)
        self.fetch_all("the initial parameters from the shards")

    def resume(self, round_: int) -> None:
        """Rejoin a recovered job: fetch the restored parameters (every block at ``round_``) and count
        ``round_`` iterations as done; a cost plan already published is used as is, without profiling, and so is
        a re-tuned one (every worker of a recovered job rejoins with the newest plan)."""
        self.fetch_all("the restored parameters from the shards")
        restored = set(self.block_rounds().values())
        if restored != {round_}:
            raise IMergeError(f"worker {self.config.rank}: the shards restored rounds {sorted(restored)}, "
                              f"expected {round_} for every block")
        self.state.loop.iteration = round_
        if self.state.profiler is not None and self.plan.version >= COST_PLAN:
            self._stop_profiling(schedule_start=self.config.profile_iters)
        if self.plan.version >= COST_PLAN:
            self._start_retuning()

    def export_states(self) -> dict[str, bytes]:
        """Every block's parameters and optimizer state (safetensors bytes), from its shard."""
        return self.loop.run(self.blocks.export(self.plan.blocks), self.config.wait_timeout_s,
                             "the shards' parameters and optimizer state")

    def load_states(self, states: dict[str, bytes], timeout_s: float, what: str) -> None:
        """Import ``states`` (worker 0), announced in the store first: a shard takes an Import only then."""
        self.store.announce_loading(self.generation, timeout_s + 5.0)
        try:
            self.loop.run(self.blocks.load(self.plan.blocks, states), timeout_s, what)
        finally:
            self.store.end_loading()

    def fetch_all(self, what: str) -> None:
        """Every block's current parameters from the shards, in place; the groups at the blocks' rounds."""
        block_rounds = self.loop.run(self.blocks.fetch(self.plan.blocks), self.config.wait_timeout_s + 5.0, what)
        self.use_plan(self.plan, block_rounds)

    def share_module_state(self, tag: int) -> None:
        """Worker 0's parameters outside the plan (frozen ones) and buffers become every worker's, as DDP's
        construction broadcasts them (``tag``: JOIN_STATE when the job is joined, else an imerge.load's)."""
        self.state.buffer_sync.share(tag, 0 if tag == JOIN_STATE else self.generation, self.state.frozen)

    # -- what the API asks of the hooks ------------------------------------------------------
    def first_forward(self, args: tuple[Any, ...]) -> None:
        """The forward during which the job was joined (its root hooks were installed too late for it)."""
        hooks.first_forward(self.state, args)

    def stepped(self) -> None:
        """The loop's optimizer.step() (or a grad scaler's step of a skipped round): a held round is decided."""
        clipping.release(self.state)
        self.state.loop.stepped()

    def last_round_result(self) -> RoundResult | None:
        """What the shards said of the latest round pushed (waiting for its first block to come back)."""
        clipping.release(self.state)
        return self.state.waits.last_round(self.state.table)

    def clip_norm(self, max_norm: float, after_backward: bool) -> float:
        """The script clips the latest round to ``max_norm`` (:mod:`.clipping`): its global norm once the shards
        agree on it (0 before the first backward)."""
        clipping.clip_norm(self.state, max_norm, after_backward)
        if not self.state.loop.started:
            return 0.0
        result = self.last_round_result()
        if result is None:
            return 0.0
        return math.inf if result.skipped else result.grad_norm  # skipped: an inf or NaN in the gradient

    def clip_value(self, value: float) -> None:
        """The script clamps the latest round's gradient to [-value, value] (:mod:`.clipping`)."""
        clipping.clip_value(self.state, value)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """imerge.load assigns the module's state: the state goes to the shards its own way, not as a round."""
        self.state.loading = True
        try:
            yield
        finally:
            self.state.loading = False

    def finish(self) -> None:
        """The last syncs of a worker leaving the job: with T > 1 every group that did not sync last, then every
        group's latest; every worker ends with the same parameters and buffers."""
        clipping.release(self.state)
        rounds.flush(self.state)
        self.synchronize()
        self.comm.settle_pushes()
        self.state.buffer_sync.apply()

    def next_load(self) -> int:
        """The sequence number of this imerge.load call (1, 2, ...): the barrier worker 0 and the others meet at."""
        self._loads += 1
        return self._loads

    # -- waits and closing -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        clipping.release(self.state)
        self.state.waits.all(self.state.table)

    def disown(self) -> None:
        """In a forked child: the hooks and parameter guards removed from this process's copy of the module,
        nothing else (the comm thread and the connections are the parent's; they did not survive the fork)."""
        self._remove_hooks()

    def close(self) -> None:
        self._remove_hooks()
        if self.config.trace_dir:
            log.info("timeline written to %s", self.timeline.write(self.config.trace_dir))
        self.comm.close()
        self.loop.close()
