"""Choosing a job's schedule by simulating it: the knobs, the search, and what it decided and why.

A schedule is the product's options (:class:`ScheduleConfig`); the tuner varies
the *knobs* that decide how gradients move (fusion, push priority, the slot
policy and its scope, the partition size, the placement, and the compression
only where the caller allows it: ``compression_auto``, for a lossy
compression changes the result and is the user's to allow), never the
interleave period (staleness is the user's decision) and never a knob the user
pinned with an explicit flag. Each candidate is simulated with the product's
own policies (:mod:`.psjob`) on the job's profile and cluster; the search is
coordinate descent from the given schedule: each knob in turn takes its best
value with the others held, until a pass changes nothing (at most
``MAX_PASSES``). A value replaces the current one only if it is predicted
``MARGIN`` faster, so a tie keeps the simpler, given schedule.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from imerge.core.knobs import KNOBS, apply, describe, knob_fields, knobs_of
from imerge.core.schedule_config import ScheduleConfig

from .cluster import Cluster, Constants
from .profiles import ModelProfile
from .results import Trial, TuningReport

MARGIN = 0.01     # a candidate replaces the current schedule only if predicted this much faster
PLAN_KNOBS = frozenset({"partition", "placement"})  # the knobs that cut and place the blocks
BUDGET_CPU_S = 5.0  # a decision's simulations: a candidate whose simulation would take it past this is not tried
BlocksKey = tuple[tuple[tuple[str, str], ...], tuple[Any, ...]]  # the other knobs, and the blocks
MAX_PASSES = 2
TUNE_ITERS = 8    # iterations simulated per candidate (the first PROFILED + 1 not timed)
PROFILED = 2      # iterations fusion cost profiles in a simulated candidate

def free_knobs(pinned_fields: set[str], compression_auto: bool) -> tuple[list[str], list[str]]:
    """The knobs the tuner may vary and those the user pinned (any of the knob's fields given by a flag)."""
    free: list[str] = []
    pinned: list[str] = []
    for knob in KNOBS:
        fields = knob_fields(knob)
        if knob == "compression" and not compression_auto:
            continue
        (pinned if fields & pinned_fields else free).append(knob)
    return free, pinned


def simulate_schedule(profile: ModelProfile, cluster: Cluster, constants: Constants, schedule: ScheduleConfig,
                      iters: int = TUNE_ITERS) -> Trial:
    from .psjob import PSJob  # simpy loads only when a job is simulated

    # fusion cost profiles PROFILED iterations; the first after its switch waits for nothing: neither is timed
    run = PSJob(profile, cluster, constants, dataclasses.replace(schedule, profile_iters=PROFILED), iters,
                PROFILED + 1).run()
    return Trial({}, run.mean_iteration_s, run.exposed_comm_s)


def tune(profile: ModelProfile, cluster: Cluster, constants: Constants, base: ScheduleConfig,
         pinned_fields: frozenset[str] | set[str] = frozenset(), compression_auto: bool = False, iters: int = TUNE_ITERS,
         progress: Callable[[str], None] = lambda line: None, only: list[str] | None = None,
         budget_cpu_s: float = BUDGET_CPU_S) -> TuningReport:
    """The fastest schedule the coordinate descent finds from ``base`` (see the module's docstring); ``only``:
    the knobs it may vary (default: every knob not pinned). A candidate whose simulation would take the decision
    past ``budget_cpu_s`` CPU seconds is not tried (the report's ``skipped`` says which): a simulation costs about
    the same per worker class, and with slot flags every position in a lane is a class of its own."""
    from .psjob import first_plan, lane_positions

    started = time.process_time()
    free, pinned = free_knobs(set(pinned_fields), compression_auto)
    if only is not None:
        pinned += [knob for knob in free if knob not in only]
        free = [knob for knob in free if knob in only]
    skipped = []
    if "slots" in free and not cluster.queue_kb:
        free.remove("slots")  # flags only serialize pushes; what they buy is a port queue that does not overflow
        skipped.append("slots: no shard port queue given (--queue-kb), so no incast for flags to avoid")
    current = knobs_of(base, free)
    tried: dict[tuple[tuple[str, str], ...], Trial] = {}
    over_budget: set[tuple[tuple[str, str], ...]] = set()
    per_class = [0.0]  # the most CPU seconds a simulation took per worker class so far
    by_blocks: dict[BlocksKey, Trial] = {}  # (the other knobs, the blocks on the shards) -> its trial

    def same_blocks(knobs: dict[str, str]) -> BlocksKey | None:
        """Candidates that differ only in partition or placement but cut and place the same blocks (from 8 shards
        on the partition follows the shard count) simulate alike: one key for them."""
        if not PLAN_KNOBS & set(knobs):
            return None
        blocks = first_plan(profile, cluster, apply(base, knobs)).blocks
        return tuple(sorted((k, v) for k, v in knobs.items() if k not in PLAN_KNOBS)), blocks

    def simulated(knobs: dict[str, str], classes: int) -> Trial:
        began = time.process_time()
        trial = simulate_schedule(profile, cluster, constants, apply(base, knobs), iters)
        per_class[0] = max(per_class[0], (time.process_time() - began) / classes)
        return remember(knobs, trial)

    def remember(knobs: dict[str, str], trial: Trial) -> Trial:
        key = tuple(sorted(knobs.items()))
        tried[key] = dataclasses.replace(trial, knobs=dict(knobs))
        blocks = same_blocks(knobs)
        if blocks is not None:
            by_blocks.setdefault(blocks, tried[key])
        progress(f"{describe(knobs)}: {tried[key].mean_iteration_s:.4f} s/it")
        return tried[key]

    def predicted(knobs: dict[str, str]) -> Trial | None:
        """The candidate's trial; None where its simulation would pass the budget."""
        key = tuple(sorted(knobs.items()))
        if key in tried or key in over_budget:
            return tried.get(key)
        blocks = same_blocks(knobs)
        twin = by_blocks.get(blocks) if blocks is not None else None
        if twin is not None:  # the same blocks as a candidate simulated: its result, not simulated again
            return remember(knobs, twin)
        classes = len(lane_positions(apply(base, knobs), cluster))
        estimate = per_class[0] * classes
        if time.process_time() - started + estimate > budget_cpu_s:
            over_budget.add(key)
            skipped.append(f"{describe(knobs)}: its simulation ({classes} worker classes, about {estimate:.1f} CPU "
                           f"s) would take the decision past its budget of {budget_cpu_s:g} CPU s")
            return None
        return simulated(knobs, classes)

    best = simulated(current, len(lane_positions(apply(base, current), cluster)))  # the given schedule: always
    for _ in range(MAX_PASSES):
        changed = False
        for knob in free:
            for value in KNOBS[knob]:
                candidate = predicted({**current, knob: value})
                if candidate is not None and candidate.mean_iteration_s < best.mean_iteration_s * (1 - MARGIN):
                    best, current, changed = candidate, dict(candidate.knobs), True
        if not changed:
            break
    trials = sorted(tried.values(), key=lambda t: t.mean_iteration_s)
    runner_up = next((t for t in trials if t.knobs != best.knobs), None)
    return TuningReport(profile.name, cluster.workers, cluster.shards, cluster.worker_gbit, pinned, best, runner_up,
                        trials, time.process_time() - started, skipped)


def chosen_schedule(report: TuningReport, base: ScheduleConfig) -> ScheduleConfig:
    """The chosen schedule: ``base`` with the chosen knob values."""
    return apply(base, report.chosen.knobs)


def explain_markdown(report: TuningReport) -> str:
    """The decision, the runner-up and every candidate simulated, as ``imerge simulate --explain`` prints it."""
    chosen, runner_up = report.chosen, report.runner_up
    lines = [f"{report.model}, {report.workers} workers, {report.shards} shards, links {report.link_gbit:g} Gbit/s: "
             f"chosen {describe(chosen.knobs)}, predicted {chosen.mean_iteration_s:.4f} s/it"]
    if runner_up is not None:
        lines.append(f"runner-up {describe(runner_up.knobs)}, predicted {runner_up.mean_iteration_s:.4f} s/it "
                     f"({runner_up.mean_iteration_s / chosen.mean_iteration_s - 1:+.1%})")
    lines.append(f"pinned by flags: {', '.join(report.pinned) or 'none'}; decided in {report.decided_in_cpu_s:.1f} "
                 f"CPU s over {len(report.trials)} candidates")
    lines += [f"not tried: {reason}" for reason in report.skipped]
    knobs = list(chosen.knobs)
    lines += ["", "| " + " | ".join(knobs) + " | predicted s/it | x chosen |", "|" + "---|" * (len(knobs) + 2)]
    for trial in report.trials:
        lines.append("| " + " | ".join(trial.knobs[k] for k in knobs) +
                     f" | {trial.mean_iteration_s:.4f} | {trial.mean_iteration_s / chosen.mean_iteration_s:.3f} |")
    return "\n".join(lines) + "\n"
