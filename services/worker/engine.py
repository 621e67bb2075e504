"""The worker's sync engine: wires the flat buffers, the hooks and the comm loop to one plan.

* :mod:`.buffers`: every parameter is a view into one flat tensor; the group
  runtimes of the current plan (:class:`GroupTable`).
* :mod:`.hooks`: the gradient hooks and forward waits, and the iteration count.
* :mod:`.comm`: the comm thread: queue, pushes under the slot policy
  (:mod:`imerge.core.slots`), pulls, the groups' Futures.
* :mod:`.profiler`: with ``--fusion cost`` the first iterations are profiled;
  then the coordinator's cost plan regroups the (unchanged) blocks.

The engine itself creates the blocks on the shards (rank 0), fetches the
parameters (at start and when rejoining a recovered job) and switches plans.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from imerge.control.messages import COST_PLAN, BlocksReady
from imerge.core.compression import block_modes
from imerge.core.errors import IMergeError, JobFailed
from imerge.core.planning import Plan
from imerge.core.slots import effective_policy, make_slots, resolve_width
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams, GroupTable
from .comm import CommLoop, Communicator
from .config import WorkerConfig
from .hooks import Hooks
from .metrics import WorkerMetrics
from .model_buffers import BufferSync
from .optimizer import ShardOptimizer
from .profiler import Profiler, cost_plan
from .saving import block_states, check_optimizer_state
from .transport import ShardClient

log = logging.getLogger(__name__)
JOIN_STATE = -1  # the tag of worker 0's module state shared when the job is joined (imerge.load #n: -1 - n)


class SyncEngine:
    def __init__(self, model: torch.nn.Module, names: list[str], plan: Plan, config: WorkerConfig,
                 optimizer: ShardOptimizer, store: Any, generation: int = 0):
        self.config = config
        self.generation = generation
        self.optimizer = optimizer
        self.loads = 0  # imerge.load calls: each is one barrier between worker 0 and the others
        self.store = store
        self.timeline = Timeline(config.rank)
        self.metrics = WorkerMetrics(config.rank, config.link_mbps)
        by_name = dict(model.named_parameters())
        self.params = [by_name[n] for n in names]
        self.flat = FlatParams(self.params)
        self.loop = CommLoop(f"imerge-comm-{config.rank}")
        clients = self.loop.run(self._connect(plan), 30, "the shard channels to open")
        width = resolve_width(config.slot_scope, config.slot_width, len(plan.shard_addresses))
        policy = effective_policy(config.slots, width, plan.num_workers)
        if policy != config.slots:
            log.info("worker %d: slots %s with width %d >= %d workers guard nothing; pushing without flags",
                     config.rank, config.slots, width, plan.num_workers)
        slots = make_slots(policy, store, owner=f"w{config.rank}", lease_s=config.flag_lease_s,
                           timeout_s=config.pull_timeout_s, generation=generation,
                           bandwidth_mbps=config.slot_bandwidth_mbps)
        self.comm = Communicator(self.loop, clients, self.flat, slots, rank=config.rank, priority=config.priority,
                                 rpc_timeout_s=config.rpc_timeout_s, pull_timeout_s=config.pull_timeout_s,
                                 generation=generation, metrics=self.metrics, timeline=self.timeline,
                                 slot_scope=config.slot_scope, slot_width=width,
                                 compression=block_modes(config.compression_spec(), plan))
        self.hooks = Hooks(self.flat, self.comm, config, optimizer, self.metrics, self.timeline,
                           {id(by_name[n]): n for n in names})
        optimizer.on_step = self.hooks.stepped
        self.hooks.buffer_sync = BufferSync(model, store, rank=config.rank, world_size=config.world_size,
                                            mode=config.buffers, generation=generation,
                                            timeout_s=config.pull_timeout_s + config.rpc_timeout_s)
        self.use_plan(plan, {b.block_id: 0 for b in plan.blocks})
        if config.fusion == "cost" or (config.profile_out and config.rank == 0):
            self._start_profiling()
        self.hooks.install(model, self.params)

    # -- plans ---------------------------------------------------------------------------
    async def _connect(self, plan: Plan) -> list[ShardClient]:
        return [ShardClient(address, self.config, self.config.data_path) for address in plan.shard_addresses]

    @property
    def plan(self) -> Plan:
        return self.hooks.table.plan

    @property
    def iteration(self) -> int:
        return self.hooks.iteration

    @property
    def groups(self) -> list:
        return self.hooks.table.groups

    def block_rounds(self) -> dict[str, int]:
        return {b.block_id: g.round for g in self.hooks.table.groups for b in g.blocks}

    def use_plan(self, plan: Plan, block_rounds: dict[str, int]) -> None:
        """Group the (unchanging) blocks as ``plan`` says, each group at its blocks' round."""
        if self.hooks.table is not None:
            self.hooks.settle_accumulator()
        self.hooks.table = GroupTable(plan, self.flat, self.params, block_rounds)
        self.comm.plan_version = plan.version

    def _start_profiling(self) -> None:
        self.hooks.profiler = Profiler(len(self.plan.units), plans=self.config.fusion == "cost")
        self.comm.on_push = self.hooks.profiler.push
        self.hooks.after_backward = self._after_profiled_backward

    def _stop_profiling(self) -> None:
        self.hooks.profiler = None
        self.comm.on_push = None
        self.hooks.after_backward = None

    def _after_profiled_backward(self) -> None:
        if self.hooks.iteration != self.config.profile_iters:
            return
        if self.config.profile_out and self.config.rank == 0:
            self.hooks.profiler.write(self.config.profile_out, self.plan)
        if not self.hooks.profiler.plans:
            self._stop_profiling()
            return
        self.synchronize()
        plan = cost_plan(self.store, self.hooks.profiler, self.plan, self.config.rank,
                         self.config.wait_timeout_s, self.comm.compression.estimate)
        self.use_plan(plan, self.block_rounds())
        self.hooks.schedule_start = self.hooks.iteration
        self._stop_profiling()
        log.info("worker %d: cost plan v%d with %d groups from iteration %d", self.config.rank, plan.version,
                 len(plan.groups), self.hooks.iteration)

    # -- the blocks on the shards ------------------------------------------------------------
    def initialize(self, optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Rank 0 creates every block (with ``optimizer_state``, per parameter: a torch optimizer's loaded state);
        then every worker fetches the current parameters."""
        cfg = self.config
        if cfg.rank == 0:
            try:
                self.loop.run(self._init_blocks(), cfg.rpc_timeout_s * 4,
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
        self.loop.run(self.fetch_all(), cfg.wait_timeout_s + 5.0, "the initial parameters from the shards")

    def resume(self, round_: int) -> None:
        """Rejoin a recovered job: fetch the restored parameters (every block at ``round_``) and count
        ``round_`` iterations as done; a cost plan already published is used as is, without profiling."""
        self.loop.run(self.fetch_all(), self.config.wait_timeout_s + 5.0, "the restored parameters from the shards")
        rounds = set(self.block_rounds().values())
        if rounds != {round_}:
            raise IMergeError(f"worker {self.config.rank}: the shards restored rounds {sorted(rounds)}, "
                              f"expected {round_} for every block")
        self.hooks.iteration = round_
        if self.hooks.profiler is not None and self.plan.version == COST_PLAN:
            self._stop_profiling()
            self.hooks.schedule_start = self.config.profile_iters

    async def _init_blocks(self) -> None:
        self.flat.stage_to_host()
        await asyncio.gather(*(
            self.comm.clients[b.shard].init_block(b.block_id, self.plan.num_workers,
                                                  self.optimizer.spec.group(self.plan.units[b.unit].group),
                                                  self.flat.host_slice(b), self.config.rpc_timeout_s,
                                                  [numel for _, numel in self.flat.pieces(b)],
                                                  self.comm.compression.mode(b.block_id))
            for b in self.plan.blocks))

    async def export_states(self) -> dict[str, bytes]:
        """Every block's parameters and optimizer state (safetensors bytes), from its shard."""
        by_shard: dict[int, list[str]] = {}
        for block in self.plan.blocks:
            by_shard.setdefault(block.shard, []).append(block.block_id)
        replies = await asyncio.gather(*(self.comm.clients[shard].export_blocks(ids, self.config.rpc_timeout_s,
                                                                                self.generation)
                                         for shard, ids in by_shard.items()))
        return {block_id: data for reply in replies for block_id, data in reply.items()}

    def load_states(self, states: dict[str, bytes], timeout_s: float, what: str) -> None:
        """Import ``states`` (worker 0), announced in the store first: a shard takes an Import only then."""
        self.store.announce_loading(self.generation, timeout_s + 5.0)
        try:
            self.loop.run(self.import_states(states), timeout_s, what)
        finally:
            self.store.end_loading()

    async def import_states(self, states: dict[str, bytes]) -> None:
        by_shard: dict[int, dict[str, bytes]] = {}
        for block in self.plan.blocks:
            by_shard.setdefault(block.shard, {})[block.block_id] = states[block.block_id]
        await asyncio.gather(*(self.comm.clients[shard].import_blocks(items, self.config.rpc_timeout_s,
                                                                      self.generation)
                               for shard, items in by_shard.items()))

    async def fetch_all(self) -> None:
        by_shard: dict[int, list] = {}
        for block in self.plan.blocks:
            by_shard.setdefault(block.shard, []).append(block)
        replies = await asyncio.gather(*(
            self.comm.clients[shard].fetch_into([(b.block_id, self.flat.host_slice(b)) for b in blocks],
                                                self.config.wait_timeout_s, self.generation)
            for shard, blocks in by_shard.items()))
        rounds = {b.block_id: r for blocks, reply in zip(by_shard.values(), replies) for b, r in zip(blocks, reply)}
        self.flat.load_from_host(0, self.flat.values.numel())
        self.use_plan(self.plan, rounds)

    def share_module_state(self, tag: int) -> None:
        """Worker 0's parameters outside the plan (frozen ones) and buffers become every worker's, as DDP's
        construction broadcasts them (``tag``: JOIN_STATE when the job is joined, else an imerge.load's)."""
        self.hooks.buffer_sync.share(tag, 0 if tag == JOIN_STATE else self.generation, self.hooks.frozen)

    # -- waits and closing -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        self.hooks.synchronize()

    def close(self) -> None:
        self.hooks.remove()
        if self.config.trace_dir:
            log.info("timeline written to %s", self.timeline.write(self.config.trace_dir))
        self.comm.close(self.hooks.table.groups)
        self.loop.close()
