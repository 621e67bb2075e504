"""A running job's schedule decision (``--tune``): the tuner fed with what the job measured. Pure but for simpy.

The coordinator calls :func:`decide` at the plan switch with worker 0's
profile of its first iterations (each unit's forward and backward time, the
push cost ``alpha + beta * bytes`` fitted to its pushes) and what it knows of
the cluster: the link rate (``--link-gbit``; unknown: the rate the pushes
measured, ``1 / beta``), the shard port's queue (``--queue-kb``; unknown: no
slot flags are tried, there is no incast for them to avoid) and a calibration
of the constants (``--calibration``; default: real hosts, each its own cores).
Where the link rate is the measured one, the data path's CPU is already in it
and is not counted again.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from imerge.core.knobs import KNOBS
from imerge.core.planning import Layout, Plan, PlanOptions, fuse_cost, make_plan
from imerge.core.schedule_config import MIB, ScheduleConfig

from .cluster import GBIT, Cluster, Constants
from .profiles import ModelProfile, from_measurement
from .results import Trial, TuningReport
from .tuning import simulate_schedule, tune

DEFAULT_GBIT = 10.0  # the link rate assumed where neither --link-gbit nor a push measured it
CONTENTION_STEPS = 4  # simulations (after the first) that take the shared cores' contention out of a profile
ANCHORED = 0.05  # the profiled iteration's simulated time must come this close to the measured one to anchor on it


class Profile(Protocol):
    """Worker 0's measurement (the control plane's Profile message): when each unit's gradient is ready in
    backward, its bytes, the push cost, each unit's forward time (empty: not measured)."""

    @property
    def ready_s(self) -> Sequence[float]: ...
    @property
    def unit_bytes(self) -> Sequence[int]: ...
    @property
    def alpha_s(self) -> float: ...
    @property
    def beta_s_per_byte(self) -> float: ...
    @property
    def forward_s(self) -> Sequence[float]: ...
    @property
    def iteration_s(self) -> float: ...
    def backward_s(self) -> list[float]: ...


@dataclasses.dataclass(frozen=True)
class JobDecision:
    """What the coordinator publishes: the chosen knob values, and the tuner's report."""

    knobs: dict[str, str]
    report: TuningReport

    @property
    def fusion(self) -> str:
        return self.knobs.get("fusion", "")

    def plan_fields(self) -> dict[str, Any]:
        """The decision as the plan carries it (:class:`~imerge.core.planning.Plan`'s knobs, predicted_s, runner_up,
        runner_up_s); every knob value checked against :data:`KNOBS`."""
        runner = self.report.runner_up
        return {"knobs": plan_knobs(self.knobs), "predicted_s": self.report.chosen.mean_iteration_s,
                "runner_up": plan_knobs(runner.knobs) if runner else (),
                "runner_up_s": runner.mean_iteration_s if runner else 0.0}


def job_profile(profile: Profile, plan: Plan, name: str = "job") -> ModelProfile:
    """The simulator's profile of the job: the plan's units with worker 0's measured times, and the groups fusion
    cost gives them (a fusion cost candidate is simulated with the plan the job would run)."""
    forward = list(profile.forward_s) or [0.0] * len(plan.units)
    model = from_measurement(name, [(u.module, u.numel, u.group) for u in plan.units], forward, profile.backward_s(),
                             profile.alpha_s, profile.beta_s_per_byte)
    return dataclasses.replace(model, cost_groups=tuple(tuple(group) for group in cost_groups(profile)))


def cost_groups(profile: Profile) -> list[list[int]]:
    """The units' groups under fusion cost: from the profile's ready times, bytes and fitted push cost."""
    return fuse_cost(list(profile.ready_s), list(profile.unit_bytes), profile.alpha_s, profile.beta_s_per_byte)


def job_cluster(profile: Profile, plan: Plan, link_gbit: float, queue_kb: float) -> Cluster:
    """The cluster the job runs on: given link rate, or the one its pushes measured (CPU included)."""
    workers, shards = plan.num_workers, len(plan.shard_addresses)
    if link_gbit > 0:
        return Cluster(workers, shards, link_gbit, link_gbit, queue_kb)
    measured = 1 / (profile.beta_s_per_byte * GBIT) if profile.beta_s_per_byte > 0 else DEFAULT_GBIT
    return Cluster(workers, shards, measured, measured, queue_kb, shard_cores=0, worker_cores=0)


def job_constants(profile: Profile, calibration: Constants | None) -> Constants:
    """A calibration as given; else real hosts' defaults with the latency the pushes measured (half of alpha)."""
    if calibration is not None:
        return calibration
    return Constants(latency_s=profile.alpha_s / 2) if profile.alpha_s > 0 else Constants()


def profiled_schedule(base: ScheduleConfig) -> ScheduleConfig:
    """The schedule worker 0's profile was measured under: plan v1's, where fusion cost (and a tuned fusion) keep
    one group per module until the switch; a fusion the user gave groups the first plan already."""
    return dataclasses.replace(base, fusion="none") if base.fusion == "cost" else base


def uncontended(model: ModelProfile, cluster: Cluster, constants: Constants, base: ScheduleConfig,
                iteration_s: float = 0.0) -> ModelProfile:
    """The job's profile as the simulator's compute times mean them (each worker alone on its cores).

    Where the constants share their cores among every process (``cores``: the testbed, every host on one
    machine), worker 0 measured its compute while the other workers and the shards ran beside it, so its times
    already hold the contention the simulator adds again. The profile is scaled until the simulated iteration of
    the profiled schedule (plan v1's, :func:`profiled_schedule`) takes the measured ``iteration_s``: the
    prediction is then anchored where it was measured, whatever of the contention the model lacks (a worker's
    comm thread holding the interpreter its hooks need: VGG's compute reads 7x its alone-time there, 4x
    simulated). Where no scale reaches it within :data:`ANCHORED` (the links, not the compute, set that
    iteration's pace; or no iteration time measured), the simulated compute (iteration time less the forward
    waits) is matched to the measured one instead. A few simulations each."""
    if not constants.cores or model.compute_s <= 0:
        return model
    profiled = profiled_schedule(base)

    def simulated(compute_s: float) -> Trial:
        return simulate_schedule(model.scaled(compute_s), cluster, constants, profiled)

    def iteration(compute_s: float) -> float:
        return simulated(compute_s).mean_iteration_s

    def compute(compute_s: float) -> float:
        run = simulated(compute_s)
        return run.mean_iteration_s - (run.exposed_comm_s or 0.0)

    if iteration_s > 0:
        compute_s, reached = _solve(iteration, iteration_s, model.compute_s)
        if abs(reached / iteration_s - 1) <= ANCHORED:
            return model.scaled(compute_s)
    compute_s, _ = _solve(compute, model.compute_s, model.compute_s)
    return model.scaled(compute_s)


def _solve(simulated: Callable[[float], float], target: float, measured: float) -> tuple[float, float]:
    """The compute (between 5% of ``measured`` and ``measured``) whose ``simulated`` value is nearest ``target``,
    by secant steps (``simulated`` increasing, not through 0) from ``measured``; and that value."""
    points = [(measured, simulated(measured))]
    guess = measured * target / points[0][1] if points[0][1] > 0 else measured
    for _ in range(CONTENTION_STEPS):
        guess = min(measured, max(0.05 * measured, guess))
        points.append((guess, simulated(guess)))
        if abs(points[-1][1] / target - 1) < 0.02:
            break
        (x0, y0), (x1, y1) = points[-2:]
        guess = x1 - (y1 - target) * (x1 - x0) / (y1 - y0) if y1 != y0 else x1 * target / y1
    return min(points, key=lambda point: abs(point[1] - target))


def decide(profile: Profile, plan: Plan, options: PlanOptions, base: ScheduleConfig, *, link_gbit: float = 0.0,
           queue_kb: float = 0.0, calibration: Constants | None = None,
           progress: Callable[[str], None] = lambda line: None) -> JobDecision:
    """The knobs of ``options.tune`` chosen for the job (the others as ``base`` has them)."""
    base = dataclasses.replace(base, fusion=options.fusion, tune="none",  # the job's own blocks, whatever the link
                               partition_mib=options.partition_bytes / MIB)
    cluster, constants = job_cluster(profile, plan, link_gbit, queue_kb), job_constants(profile, calibration)
    model = uncontended(job_profile(profile, plan), cluster, constants, base, profile.iteration_s)
    report = tune(model, cluster, constants, base, only=options.tuned_knobs, progress=progress)
    return JobDecision(dict(report.chosen.knobs), report)


def decided_plan(layout: Layout, options: PlanOptions, first: Plan, profile: Profile, knobs: dict[str, str],
                 fields: dict[str, Any], version: int) -> Plan:
    """The plan of ``version``: the blocks of ``first`` grouped by the fusion ``knobs`` give (or ``options``' where
    they give none; fusion cost: from ``profile``'s ready times and push cost), with ``fields`` (a decision's
    :meth:`JobDecision.plan_fields`)."""
    options = dataclasses.replace(options, fusion=knobs.get("fusion") or options.fusion)
    groups = cost_groups(profile) if options.fusion == "cost" else None
    plan = make_plan(layout, first.num_workers, first.shard_addresses, version, options, groups=groups,
                     blocks_of=first.blocks)
    return dataclasses.replace(plan, **fields)


def plan_knobs(knobs: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The knob values as a plan carries them (every name checked against :data:`KNOBS`)."""
    for knob, value in knobs.items():
        if value not in KNOBS.get(knob, {}):
            raise ValueError(f"unknown knob value {knob}={value!r}")
    return tuple(sorted(knobs.items()))
