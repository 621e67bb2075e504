"""One IMerge job, simulated: the workers' hooks, comm queue, senders, slots and pulls; the shards' rounds.

The policies are the product's own: the plan (fusion, partitions, placement)
comes from :func:`imerge.core.planning.make_plan` and, for fusion cost,
:func:`fuse_cost` over the profile that the simulated worker 0 measured in its
first iterations (ready times and a cost fitted to its timed pushes, as the
worker does); the comm queue is :class:`imerge.core.queue.CommQueue`, the
push streams are the sending kernel's (:mod:`imerge.core.sending`); what each backward does group by
group is the worker's backward policy (:mod:`imerge.core.backward`); a block's round is the shard's kernel
(:mod:`imerge.core.blockround`); the slot width and whether flags are
taken come from :mod:`imerge.core.slots`, fixed slots hold for
:meth:`SlotClock.slot_time`; wire bytes from :mod:`imerge.core.compression`.

What the worker does, step by step (``services/worker``): a module's forward
waits for its blocks' latest pull; backward produces the units' gradients in
order; a complete group that syncs in this iteration is queued (with overlap)
and the next group's gradients wait for its previous push; the comm loop takes
the highest-priority group, spends ``sync_cpu_s`` per shard the group touches
(its pull request and push stream, the Futures around them: a cost per group,
whatever its bytes, which is what makes one group per module dearer than size
fusion where the cores are busy), starts its pull, and hands its blocks to the
sending kernel (:mod:`imerge.core.sending`, the worker's own), which batches
each shard's queued blocks into push streams up to its byte credit with a
bounded number unanswered, or, with slots scoped to (group, shard), orders the
group's shards in turn under their flags; this module only carries its
streams out over the simulated links. A shard's block counts each push as the
shard's own kernel of a block's rounds does (:mod:`imerge.core.blockround`, a
worker class's push for each of its workers), completes the round when the
kernel says every worker's push is in, steps it, and answers each waiting pull.

Identical workers are simulated once per *class*: without flags every worker
is alike (one class); with flags, the workers that share a lane take it in turn,
so each position in a lane is a class. Shards with the same bytes per group are
one class too (beyond ``max_shard_classes``, bytes within a few percent).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterator
from typing import Any

import simpy

from imerge.core.backward import BackwardPolicy, Enqueue, LocalStep, WaitAll
from imerge.core.blockround import Aggregate, BlockRound, Publish, Receive
from imerge.core.errors import ConfigError
from imerge.core.modes import block_modes, payload_bytes, topk_count
from imerge.core.planning import BYTES_PER_ELEMENT, COST_PLAN, FIRST_PLAN, Plan, fit_cost, fuse_cost, make_plan
from imerge.core.queue import STOP, CommQueue
from imerge.core.rounds import Push
from imerge.core.sending import SendPolicy, Senders, Stream
from imerge.core.schedule import SyncSchedule
from imerge.core.schedule_config import ScheduleConfig
from imerge.core.slots import SlotClock, effective_policy, resolve_width

from .cluster import GBIT, Cluster, Constants
from .fluid import Fabric, Link, Process, data_path
from .profiles import ModelProfile
from .results import SimRun



@dataclasses.dataclass
class Sync:
    """One sync of a group by one worker class: its blocks (on representative shards) and their arrivals."""

    group: int
    iteration: int
    rounds: dict[int, int]                  # block -> the round it pushes
    arrived: dict[int, simpy.Event]         # block -> its pulled parameters are in place
    shard_done: dict[int, simpy.Event]      # shard class -> every block of the group on it is back
    pushes_left: int
    pulls_left: dict[int, int]
    push_done: simpy.Event
    pull_done: simpy.Event


@dataclasses.dataclass(eq=False)
class ShardClass:
    index: int
    shards: list[int]
    rep: int
    uplink: Link
    downlink: Link
    cpu: tuple[Link, ...]  # its data path's cores (on real hosts), one link or none
    rounds: dict[int, BlockRound] = dataclasses.field(default_factory=dict)  # block -> its rounds (the shard's kernel)
    waiting: dict[tuple[int, int], list[tuple[WorkerClass, Sync]]] = dataclasses.field(default_factory=dict)
    answers: dict[int, list[tuple[Sync, int]]] = dataclasses.field(default_factory=dict)  # worker class -> blocks to send, in order


@dataclasses.dataclass(eq=False)
class WorkerClass:
    index: int
    rank: int
    count: int
    uplink: Link
    downlink: Link
    cpu: tuple[Link, ...]
    queue: CommQueue
    wake: simpy.Event
    plan: Plan
    policy: BackwardPolicy  # what each backward does, group by group (the worker's own kernel)
    latest: dict[int, Sync] = dataclasses.field(default_factory=dict)    # group -> its latest sync
    pushed_round: dict[int, int] = dataclasses.field(default_factory=dict)  # block -> the round its latest sync pushes
    starts: list[float] = dataclasses.field(default_factory=list)        # each iteration's forward start
    waited: list[float] = dataclasses.field(default_factory=list)        # each iteration's forward waits
    ready: list[list[float]] = dataclasses.field(default_factory=list)   # profiled: each unit's gradient ready
    pushes: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # profiled: (bytes, seconds)
    fixed: SlotClock | None = None
    moved_before: tuple[float, float] = (0.0, 0.0)  # its links' bytes when counting began


def first_plan(profile: ModelProfile, cluster: Cluster, schedule: ScheduleConfig) -> Plan:
    """The plan a simulated job starts with: the coordinator's for the same layout, workers, shards and options."""
    addresses = tuple(f"ps{s}" for s in range(cluster.shards))
    return make_plan(profile.layout(), cluster.workers, addresses, FIRST_PLAN,
                     schedule.plan_options(cluster.worker_gbit * 1000))


def lane_positions(schedule: ScheduleConfig, cluster: Cluster) -> list[tuple[int, int]]:
    """The worker classes a job is simulated with, as (first rank, workers): one without flags; with flags, one per
    position in a lane (lane members take the flag in turn), each as many workers as the slot has lanes."""
    workers = cluster.workers
    lanes = resolve_width(schedule.slot_scope, schedule.slot_width, cluster.shards)
    if effective_policy(schedule.slots, lanes, workers) == "off":
        return [(0, workers)]
    return [(p * lanes, min(lanes, workers - p * lanes)) for p in range(-(-workers // lanes))]


class PSJob:
    """Run with :meth:`run`; read :attr:`result`."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, constants: Constants, schedule: ScheduleConfig,
                 iters: int, warmup: int, max_shard_classes: int = 16, traced: bool = False):
        self.profile, self.cluster, self.k, self.schedule = profile, cluster, constants, schedule
        self.iters, self.warmup, self.max_shard_classes = iters, warmup, max_shard_classes
        # bytes are counted from the iteration before the first timed one: the first after a plan switch, when
        # nothing is in flight (its time is not taken: it waits for nothing)
        self._bytes_from = max(0, warmup - 1)
        self.env = simpy.Environment()
        self.fabric = Fabric(self.env, constants.cores)
        self.host_cap = constants.host_gbit * GBIT if constants.host_gbit else math.inf
        shared_cores = bool(constants.cores)  # the testbed: cpu_per_byte on shared cores instead
        self.shard_cpu, self.worker_cpu = (0.0, 0.0) if shared_cores else constants.data_path_costs(schedule.data_path)
        width = resolve_width(schedule.slot_scope, schedule.slot_width, cluster.shards)
        self.policy = effective_policy(schedule.slots, width, cluster.workers)  # the classes: lane_positions
        self.first_plan = first_plan(profile, cluster, schedule)
        if len(self.first_plan.units) != len(profile.units):  # the times would be matched to the wrong units
            raise ConfigError("profile", f"{profile.name}: its {len(profile.units)} units plan as "
                                         f"{len(self.first_plan.units)}; each unit must be one module and group")
        self.cost_plan: simpy.Event | None = self.env.event() if schedule.fusion == "cost" else None
        self.modes = block_modes(schedule.compression_spec(), self.first_plan)
        self.shard_classes, self.class_of_shard = self._shard_classes(self.first_plan)
        # with ``traced``, the kernels' traces (core.blockround.replay, core.backward.replay): block -> its rounds',
        # worker class -> its backward passes'
        self.round_traces: dict[int, list[dict[str, Any]]] | None = {} if traced else None
        self.backward_traces: dict[int, list[dict[str, Any]]] | None = {} if traced else None
        self.workers = self._worker_classes()
        self.flags: dict[tuple[object, ...], simpy.Resource] = {}
        self.unit_fwd = [u.forward_s for u in profile.units]
        self.unit_bwd = [u.backward_s for u in profile.units]
        self.published: Plan | None = None  # the plan the simulated coordinator published last
        self.submitted_profile: dict[str, Any] | None = None  # what the simulated worker 0 submitted for it
        self.result: SimRun | None = None
        self._unit_blocks: dict[int, list[list[int]]] = {}   # plan version -> each unit's blocks
        self._group_of_unit: dict[int, dict[int, int]] = {}  # plan version -> unit -> group
        self._group_blocks: dict[int, list[dict[int, list[int]]]] = {}  # version -> group -> shard class -> blocks
        self._group_shards: dict[int, list[int]] = {}  # plan version -> group -> the shards its blocks are on
        self._index_plan(self.first_plan)

    # -- classes ------------------------------------------------------------------------------
    def _shard_classes(self, plan: Plan) -> tuple[list[ShardClass], list[int]]:
        shards = self.cluster.shards
        vectors = [[0] * len(plan.groups) for _ in range(shards)]
        for group in plan.groups:
            for index in group.blocks:
                block = plan.blocks[index]
                vectors[block.shard][group.index] += block.numel
        members: dict[tuple[int, ...], list[int]] = {}
        for shard, vector in enumerate(vectors):
            members.setdefault(tuple(vector), []).append(shard)
        quantum = 1.01
        while len(members) > self.max_shard_classes:  # shards of about the same bytes: one class
            members = {}
            for shard, vector in enumerate(vectors):
                total = sum(vector)
                members.setdefault((round(math.log(total) / math.log(quantum)) if total else -1,), []).append(shard)
            quantum = 1 + (quantum - 1) * 1.5
        classes: list[ShardClass] = []
        class_of = [0] * shards
        rate = self.cluster.shard_gbit * GBIT
        for index, alike in enumerate(members.values()):
            rep = max(alike, key=lambda s: (sum(vectors[s]), -s))  # the busiest: the iteration waits for it
            classes.append(ShardClass(index, alike, rep, self._link(f"ps{rep}.up", rate),
                                      self._link(f"ps{rep}.down", rate, incast=True),
                                      data_path(f"ps{rep}.cpu", self.cluster.shard_cores, self.shard_cpu)))
            for shard in alike:
                class_of[shard] = index
        return classes, class_of

    def _link(self, name: str, rate: float, incast: bool = False) -> Link:
        return Link(name, rate, self.cluster.incast_senders if incast else math.inf, self.k.incast_efficiency)

    def _worker_classes(self) -> list[WorkerClass]:
        """One class without flags; with flags, one per position in a lane (lane members take it in turn)."""
        rate = self.cluster.worker_gbit * GBIT
        classes = []
        for index, (rank, count) in enumerate(lane_positions(self.schedule, self.cluster)):
            fixed = SlotClock(self.schedule.slot_bandwidth_mbps * 1e6 / 8) if self.policy == "fixed" else None
            trace = None if self.backward_traces is None else self.backward_traces.setdefault(index, [])
            policy = BackwardPolicy(len(self.first_plan.groups), self.schedule.overlap,
                                    SyncSchedule(self.first_plan.period), trace)
            classes.append(WorkerClass(index, rank, count, self._link(f"w{rank}.up", rate),
                                       self._link(f"w{rank}.down", rate),
                                       data_path(f"w{rank}.cpu", self.cluster.worker_cores, self.worker_cpu),
                                       CommQueue(self.schedule.priority),
                                       self.env.event(), self.first_plan, policy, fixed=fixed))
        return classes

    # -- wire bytes -----------------------------------------------------------------------------
    def push_bytes(self, block_index: int) -> int:
        block = self.first_plan.blocks[block_index]
        return self.modes[block.block_id].push_bytes(block.numel)

    def topk_s(self, block_index: int, pull: bool = False) -> float:
        """The CPU seconds a top-k selection over the block costs: a worker compresses every top-k push (in the
        push stream, as the real worker does); a shard selects what a pull sends only with --topk-pull-ratio."""
        mode = self.modes[self.first_plan.blocks[block_index].block_id]
        if mode.kind != "topk" or (pull and not mode.pull_ratio):
            return 0.0
        return self.first_plan.blocks[block_index].numel * BYTES_PER_ELEMENT * self.k.topk_cpu_per_byte

    def _cpu_per_byte(self, batch: list[tuple[Sync, int]], sizes: list[int]) -> float:
        """The CPU per wire byte of a push or pull of ``batch``: the cost per wire byte, and the cost per byte of the
        fp32 blocks they stand for (casting, summing, copying into place) spread over the wire bytes."""
        wire = sum(sizes)
        if not self.k.dense_cpu_per_byte or not wire:
            return self.k.cpu_per_byte
        dense = sum(self.first_plan.blocks[i].numel for _, i in batch) * BYTES_PER_ELEMENT
        return self.k.cpu_per_byte + self.k.dense_cpu_per_byte * dense / wire

    def pull_bytes(self, block_index: int) -> int:
        """A pull of top-k sends what changed, sparse where smaller than dense: with momentum (the built-in job's
        SGD) every parameter a gradient ever touched keeps changing, so an exact pull is taken as dense; with
        --topk-pull-ratio r, r of the block as (index, value) pairs."""
        block = self.first_plan.blocks[block_index]
        mode = self.modes[block.block_id]
        if mode.kind != "topk" or not mode.pull_ratio:
            return payload_bytes(block.numel, mode.cast, -1)
        return min(payload_bytes(block.numel, "float32", topk_count(mode.pull_ratio, block.numel)),
                   payload_bytes(block.numel, "float32", -1))

    # -- running ----------------------------------------------------------------------------------
    def run(self) -> SimRun:
        for worker in self.workers:
            self.env.process(self._train(worker))
            self.env.process(self._consume(worker))
        self.env.run()
        self.result = self._summary()
        return self.result

    def _rep_blocks(self, plan: Plan, group_index: int) -> dict[int, list[int]]:
        """The group's blocks on each shard class's representative (the sending kernel orders their pushes)."""
        by_class: dict[int, list[int]] = {}
        for index in plan.groups[group_index].blocks:
            block = plan.blocks[index]
            shard_class = self.shard_classes[self.class_of_shard[block.shard]]
            if block.shard == shard_class.rep:
                by_class.setdefault(shard_class.index, []).append(index)
        return by_class

    def _needs(self, worker: WorkerClass, unit: int) -> Iterator[simpy.Event]:
        """What unit ``unit``'s forward waits for: its blocks' arrivals (a block on a shard that is not its class's
        representative: the representative's blocks of the same group)."""
        plan = worker.plan
        for index in self._unit_blocks[plan.version][unit]:
            block = plan.blocks[index]
            sync = worker.latest.get(self._group_of_unit[plan.version][unit])
            if sync is None:
                return
            shard_class = self.class_of_shard[block.shard]
            if block.shard == self.shard_classes[shard_class].rep:
                yield sync.arrived[index]
            elif shard_class in sync.shard_done:
                yield sync.shard_done[shard_class]

    def _index_plan(self, plan: Plan) -> None:
        unit_blocks: list[list[int]] = [[] for _ in plan.units]
        for index, block in enumerate(plan.blocks):
            unit_blocks[block.unit].append(index)
        self._unit_blocks[plan.version] = unit_blocks
        self._group_of_unit[plan.version] = {u: g.index for g in plan.groups for u in g.units}
        self._group_blocks[plan.version] = [self._rep_blocks(plan, g.index) for g in plan.groups]
        self._group_shards[plan.version] = [len({plan.blocks[i].shard for i in g.blocks}) for g in plan.groups]

    # -- the training thread ------------------------------------------------------------------------
    def _compute(self, worker: WorkerClass, seconds: float) -> simpy.Event:
        return self.fabric.compute(seconds, count=worker.count, cores=self.k.compute_cores)

    def _train(self, worker: WorkerClass) -> Process:
        profiling = self.cost_plan is not None
        if profiling:  # fusion cost's profiled iterations sync every group
            worker.policy.profiling(True)
        for iteration in range(self.iters):
            worker.starts.append(self.env.now)
            if iteration == self._bytes_from:
                self.fabric.settle()
                worker.moved_before = (worker.uplink.busy, worker.downlink.busy)
            waited = yield from self._forward(worker)
            waited += yield from self._backward(worker, iteration, profiling)
            worker.waited.append(waited)
            if profiling and iteration + 1 == self.schedule.profile_iters:
                yield from self._switch_to_cost_plan(worker)
                profiling = False
        worker.starts.append(self.env.now)
        if worker.index == 0:
            yield from self._wait_all(worker)
        self._stop_consumer(worker)

    def _forward(self, worker: WorkerClass) -> Process:
        pending, waited = 0.0, 0.0
        for unit in reversed(range(len(self.unit_fwd))):
            events = [e for e in self._needs(worker, unit) if not e.triggered]
            if events:
                if pending:
                    yield self._compute(worker, pending)
                    pending = 0.0
                started = self.env.now
                yield simpy.AllOf(self.env, events)
                waited += self.env.now - started
            pending += self.unit_fwd[unit]
        if pending:
            yield self._compute(worker, pending)
        return waited

    def _backward(self, worker: WorkerClass, iteration: int, profiling: bool) -> Process:
        """The groups' gradients in backward order, as the worker's backward policy (core/backward.py) says: a
        group's gradients wait for its previous push; a complete group that syncs is queued (with overlap), one
        that does not steps locally; without overlap every sync is queued after backward and awaited."""
        plan, policy, started, pending = worker.plan, worker.policy, self.env.now, 0.0
        ready = [0.0] * len(plan.units)
        local_bytes = 0
        policy.started(iteration)
        for group in plan.groups:
            for action in policy.gradient(group.index):
                previous = worker.latest.get(group.index)
                if isinstance(action, LocalStep):
                    local_bytes += group.numel * BYTES_PER_ELEMENT
                elif previous is not None and not previous.push_done.triggered:  # WaitPushed
                    if pending:
                        yield self._compute(worker, pending)
                        pending = 0.0
                    yield previous.push_done
            pending += sum(self.unit_bwd[u] for u in group.units)
            if policy.complete(group.index):  # Enqueue: with overlap, as soon as it is complete
                yield self._compute(worker, pending)
                pending = 0.0
                self._enqueue(worker, group.index, iteration)
            for unit in group.units:
                ready[unit] = self.env.now - started + pending
        local_s = local_bytes * self.k.step_s_per_byte
        if pending or local_s:
            yield self._compute(worker, pending + local_s)
        if profiling:
            worker.ready.append(ready)
        queued: list[int] = []
        for action in policy.ended():  # without overlap (the naive PS): every sync now, then wait for them all
            if isinstance(action, Enqueue):
                self._enqueue(worker, action.group, iteration)
                queued.append(action.group)
            elif isinstance(action, WaitAll):
                started = self.env.now
                yield simpy.AllOf(self.env, [worker.latest[g].pull_done for g in queued])
                return self.env.now - started
        return 0.0

    def _wait_all(self, worker: WorkerClass) -> Process:
        events = [s.pull_done for s in worker.latest.values() if not s.pull_done.triggered]
        if events:
            yield simpy.AllOf(self.env, events)

    def _switch_to_cost_plan(self, worker: WorkerClass) -> Process:
        """After the profiled iterations: every worker synchronizes; worker 0's profile makes the cost plan."""
        cost_plan = self.cost_plan
        assert cost_plan is not None, "the cost plan is switched to only when it was asked for"
        yield from self._wait_all(worker)
        if worker.index == 0:
            measured = worker.ready[1:] or worker.ready
            ready, latest = [], 0.0
            for unit in range(len(self.first_plan.units)):
                latest = max(latest, statistics.fmean(r[unit] for r in measured))
                ready.append(latest)
            alpha, beta = fit_cost(worker.pushes)
            unit_bytes = [0] * len(self.first_plan.units)
            for index, block in enumerate(self.first_plan.blocks):
                unit_bytes[block.unit] += self.push_bytes(index)
            self.submitted_profile = dict(ready_s=ready, unit_bytes=unit_bytes, alpha_s=alpha, beta_s_per_byte=beta)
            known = self.profile.cost_groups  # a job's own decision: the groups its coordinator will make
            groups = [list(g) for g in known] if known is not None else fuse_cost(ready, unit_bytes, alpha, beta)
            plan = make_plan(self.profile.layout(), self.cluster.workers, self.first_plan.shard_addresses, COST_PLAN,
                             self.schedule.plan_options(self.cluster.worker_gbit * 1000), groups=groups,
                             blocks_of=self.first_plan.blocks)
            self.published = plan
            self._index_plan(plan)
            cost_plan.succeed(plan)
        plan = yield cost_plan
        worker.plan = plan
        worker.policy.regrouped(len(plan.groups))
        worker.policy.restart(self.schedule.profile_iters, plan.period)
        worker.latest = {}

    # -- the comm loop -------------------------------------------------------------------------------
    def _enqueue(self, worker: WorkerClass, group_index: int, iteration: int) -> None:
        by_class = self._group_blocks[worker.plan.version][group_index]
        rounds = {}
        for blocks in by_class.values():
            for index in blocks:
                rounds[index] = worker.pushed_round.get(index, -1) + 1
                worker.pushed_round[index] = rounds[index]
        env = self.env
        sync = Sync(group_index, iteration, rounds, {i: env.event() for i in rounds},
                    {k: env.event() for k in by_class}, len(rounds), {k: len(b) for k, b in by_class.items()},
                    env.event(), env.event())
        if not rounds:  # a group with no block on any representative (cannot happen with one class per shard)
            sync.push_done.succeed()
            sync.pull_done.succeed()
        previous = worker.latest.get(group_index)
        worker.latest[group_index] = sync
        worker.queue.put(group_index, (sync, previous))
        if not worker.wake.triggered:
            worker.wake.succeed()

    def _stop_consumer(self, worker: WorkerClass) -> None:
        worker.queue.put(STOP, None)
        if not worker.wake.triggered:
            worker.wake.succeed()

    def senders_for(self, worker: WorkerClass) -> Senders[Sync, int]:
        """The sending kernel a worker of the class runs (the worker's own: its policy, its byte estimate)."""
        policy = SendPolicy(self.schedule.priority, self.policy != "off", self.schedule.slot_scope, worker.rank)
        return Senders(policy, self.push_bytes, lambda index: self.first_plan.blocks[index].offset)

    def _consume(self, worker: WorkerClass) -> Process:
        """The worker's comm loop: a group's sync off the queue starts its pull, then its pushes (the kernel's)."""
        senders = self.senders_for(worker)
        while True:
            while not len(worker.queue):
                worker.wake = self.env.event()
                yield worker.wake
            item = worker.queue.pop()
            if item is None:
                return
            sync, previous = item
            if previous is not None and not previous.pull_done.triggered:
                yield previous.pull_done
            if self.k.sync_cpu_s:  # the comm loop's own work for the sync's pull requests and push streams
                yield self.fabric.compute(self.k.sync_cpu_s * self._group_shards[worker.plan.version][sync.group],
                                          count=worker.count)
            by_class = self._group_blocks[worker.plan.version][sync.group]
            for k, blocks in by_class.items():
                for index in blocks:
                    self._expect_pull(self.shard_classes[k], worker, sync, index)
            by_shard = {self.shard_classes[k].rep: blocks for k, blocks in by_class.items()}
            if senders.policy.per_group:
                for stream in senders.group_pushes(sync.group, sync, by_shard):
                    yield from self._push(worker, self._class_of(stream.shard), list(stream.items),
                                          ("group", sync.group, stream.shard))
                continue
            self._start_streams(worker, senders, senders.submit(sync.group, sync, by_shard))

    def _class_of(self, shard: int) -> ShardClass:
        return self.shard_classes[self.class_of_shard[shard]]

    def _start_streams(self, worker: WorkerClass, senders: Senders[Sync, int], streams: list[Stream[Sync, int]]) -> None:
        for stream in streams:
            self.env.process(self._stream(worker, senders, stream))

    def _stream(self, worker: WorkerClass, senders: Senders[Sync, int], stream: Stream[Sync, int]) -> Process:
        """One push stream: the shard's next may start once its data is written, and one fewer is in flight once
        it is answered (as the worker's)."""
        written = self.env.event()
        push = self.env.process(self._push(worker, self._class_of(stream.shard), list(stream.items),
                                           ("port", stream.shard), written))
        yield written
        self._start_streams(worker, senders, senders.written(stream))
        yield push
        self._start_streams(worker, senders, senders.answered(stream))

    def _push(self, worker: WorkerClass, shard: ShardClass, batch: list[tuple[Sync, int]], flag_key: tuple[object, ...],
              written: simpy.Event | None = None) -> Process:
        """One push stream: (with flags) take the flag, send the blocks, get the reply, release the flag."""
        nbytes = sum(self.push_bytes(i) for _, i in batch)
        compress_s = sum(self.topk_s(i) for _, i in batch)  # the payloads are made before the slot is taken
        if compress_s:
            yield self.fabric.compute(compress_s, count=worker.count * len(shard.shards))
        granted = self.env.now
        flag = request = None
        if self.policy != "off":
            flag = self.flags.setdefault(flag_key, simpy.Resource(self.env, 1))
            request = flag.request()
            yield request
            yield self.env.timeout(self.k.flag_rtt_s)
            granted = self.env.now
        started = self.env.now

        def arrived(segment: int) -> None:
            sync, index = batch[segment]
            self._arrive(shard, worker, index, sync.rounds[index])

        sizes = [self.push_bytes(i) for _, i in batch]
        yield self.fabric.transfer(sizes, [(worker.uplink, len(shard.shards)), (shard.downlink, worker.count),
                                           *self._cpu_links(worker, shard)],
                                   count=worker.count * len(shard.shards), cap=self.host_cap,
                                   cpu_per_byte=self._cpu_per_byte(batch, sizes), on_segment=arrived)
        if written is not None:
            written.succeed()
        yield self.env.timeout(2 * self.k.latency_s)  # the last bytes reach the shard, its reply comes back
        seconds = self.env.now - started
        if self.cost_plan is not None and not self.cost_plan.triggered:
            worker.pushes.append((nbytes, seconds))
        if flag is not None:
            if worker.fixed is not None:
                worker.fixed.observe(nbytes, seconds)
                hold = granted + worker.fixed.slot_time(nbytes) - self.env.now
                if hold > 0:
                    yield self.env.timeout(hold)
            yield self.env.timeout(self.k.flag_rtt_s / 2)
            assert request is not None
            flag.release(request)
        for sync, _ in batch:
            sync.pushes_left -= 1
            if sync.pushes_left == 0:
                sync.push_done.succeed()

    @staticmethod
    def _cpu_links(worker: WorkerClass, shard: ShardClass) -> list[tuple[Link, float]]:
        """The data paths a push or pull between the two crosses, weighted as their links are."""
        return ([(link, float(len(shard.shards))) for link in worker.cpu]
                + [(link, float(worker.count)) for link in shard.cpu])

    # -- the shards -----------------------------------------------------------------------------------------
    def _expect_pull(self, shard: ShardClass, worker: WorkerClass, sync: Sync, index: int) -> None:
        key = (index, sync.rounds[index])
        shard.waiting.setdefault(key, []).append((worker, sync))

    def block_round(self, shard: ShardClass, index: int) -> BlockRound:
        """The kernel of block ``index``'s rounds on its shard (the shard's own: every worker's push counts, a worker
        class's push for each of its workers)."""
        machine = shard.rounds.get(index)
        if machine is None:
            trace = None if self.round_traces is None else self.round_traces.setdefault(index, [])
            machine = shard.rounds[index] = BlockRound(self.first_plan.blocks[index].block_id, self.cluster.workers,
                                                       trace=trace)
        return machine

    def _arrive(self, shard: ShardClass, worker: WorkerClass, index: int, round_: int) -> None:
        """A worker class's push of the block arrived whole: the block's round counts it (the kernel's rules)."""
        block, machine = self.first_plan.blocks[index], self.block_round(shard, index)
        push = Push(block.block_id, worker.rank, round_, "float32", block.numel)
        if not isinstance(machine.offer(push, worker.count), Receive):
            raise AssertionError(f"{push.what}: a simulated push is never a retry")
        machine.receive_started(push, worker.count)
        for action in machine.counted(push, alike=worker.count):
            if isinstance(action, Aggregate):
                self.env.process(self._complete(shard, index, action.round))

    def _complete(self, shard: ShardClass, index: int, round_: int) -> Process:
        yield self.env.timeout(self.k.latency_s)
        step_s = self.first_plan.blocks[index].numel * BYTES_PER_ELEMENT * self.k.step_s_per_byte
        step_s += self.topk_s(index, pull=True)
        if step_s:
            yield self.fabric.compute(step_s, count=len(shard.shards))
        for action in self.block_round(shard, index).completed(round_):
            if isinstance(action, Publish):
                self._publish(shard, index, round_)

    def _publish(self, shard: ShardClass, index: int, round_: int) -> None:
        """Round ``round_`` of the block completed: its waiting pulls are answered."""
        for worker, sync in shard.waiting.pop((index, round_), []):
            channel = shard.answers.setdefault(worker.index, [])
            channel.append((sync, index))
            if len(channel) == 1:  # the connection to this worker was idle
                self.env.process(self._answer(shard, worker, channel))

    def _answer(self, shard: ShardClass, worker: WorkerClass, channel: list[tuple[Sync, int]]) -> Process:
        """Send the completed blocks to one worker class over its connection, in the order they completed: the
        blocks queued meanwhile go in the next flow."""
        while channel:
            batch = list(channel)

            def arrived(segment: int) -> None:
                sync, index = batch[segment]
                self.env.process(self._arrived(sync, index))

            sizes = [self.pull_bytes(i) for _, i in batch]
            yield self.fabric.transfer(sizes, [(shard.uplink, worker.count), (worker.downlink, len(shard.shards)),
                                               *self._cpu_links(worker, shard)],
                                       count=worker.count * len(shard.shards), cap=self.host_cap,
                                       cpu_per_byte=self._cpu_per_byte(batch, sizes), on_segment=arrived)
            del channel[:len(batch)]

    def _arrived(self, sync: Sync, index: int) -> Process:
        yield self.env.timeout(self.k.latency_s)
        sync.arrived[index].succeed()
        k = self.class_of_shard[self.first_plan.blocks[index].shard]
        sync.pulls_left[k] -= 1
        if sync.pulls_left[k] == 0:
            sync.shard_done[k].succeed()
            if all(e.triggered for e in sync.shard_done.values()):
                sync.pull_done.succeed()

    # -- the result -----------------------------------------------------------------------------------------
    def _summary(self) -> SimRun:
        worker = self.workers[-1]  # the last position of a lane waits longest; without flags all are alike
        times = [b - a for a, b in zip(worker.starts, worker.starts[1:])]
        timed = times[self.warmup:] or times
        waited = worker.waited[self.warmup:] or worker.waited
        self.fabric.settle()
        up = worker.uplink.busy - worker.moved_before[0]
        down = worker.downlink.busy - worker.moved_before[1]
        return SimRun(timed, statistics.median(timed), statistics.fmean(timed), statistics.fmean(waited),
                      max(up, down) / max(1, self.iters - self._bytes_from), self.env.now, len(self.workers), len(self.shard_classes),
                      len((self.published or self.first_plan).groups))

