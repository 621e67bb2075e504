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
from collections.abc import Callable, Mapping
from typing import Any

from imerge.core.schedule_config import ScheduleConfig

from .cluster import Cluster, Constants
from .profiles import ModelProfile
from .results import Trial, TuningReport

MARGIN = 0.01     # a candidate replaces the current schedule only if predicted this much faster
MAX_PASSES = 2
TUNE_ITERS = 8    # iterations simulated per candidate (the first PROFILED + 1 not timed)
PROFILED = 2      # iterations fusion cost profiles in a simulated candidate

# knob -> its values, each a set of ScheduleConfig fields; the first value of a knob is its plainest
KNOBS: dict[str, dict[str, dict[str, Any]]] = {
    "fusion": {"none": dict(fusion="none"), "size": dict(fusion="size"), "cost": dict(fusion="cost")},
    "priority": {"on": dict(priority=True), "off": dict(priority=False)},
    "slots": {"off": dict(slots="off"), "port": dict(slots="ack", slot_scope="shard", slot_width=0),
              "port/2": dict(slots="ack", slot_scope="shard", slot_width=2),
              "group": dict(slots="ack", slot_scope="group", slot_width=1)},
    "partition": {"1 MiB": dict(partition_mib=1.0), "0.25 MiB": dict(partition_mib=0.25),
                  "4 MiB": dict(partition_mib=4.0)},
    "placement": {"lpt": dict(placement="lpt"), "stripe": dict(placement="stripe")},
    "compression": {"none": dict(compression="none"), "fp16": dict(compression="fp16"),
                    "mixed": dict(compression="mixed")},
}


def apply(base: ScheduleConfig, knobs: Mapping[str, str]) -> ScheduleConfig:
    fields: dict[str, Any] = {}
    for knob, value in knobs.items():
        fields.update(KNOBS[knob][value])
    return dataclasses.replace(base, **fields)


def knobs_of(schedule: ScheduleConfig, allowed: list[str]) -> dict[str, str]:
    """The knob values ``schedule`` has (a knob whose fields match none of its values: its first value)."""
    values = {}
    for knob in allowed:
        matching = [name for name, fields in KNOBS[knob].items()
                    if all(getattr(schedule, key) == value for key, value in fields.items())]
        values[knob] = matching[0] if matching else next(iter(KNOBS[knob]))
    return values


def free_knobs(pinned_fields: set[str], compression_auto: bool) -> tuple[list[str], list[str]]:
    """The knobs the tuner may vary and those the user pinned (any of the knob's fields given by a flag)."""
    free, pinned = [], []
    for knob, values in KNOBS.items():
        fields = {key for choice in values.values() for key in choice}
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
         pinned_fields: set[str] = frozenset(), compression_auto: bool = False, iters: int = TUNE_ITERS,
         progress: Callable[[str], None] = lambda line: None) -> TuningReport:
    """The fastest schedule the coordinate descent finds from ``base`` (see the module's docstring)."""
    started = time.process_time()
    free, pinned = free_knobs(set(pinned_fields), compression_auto)
    skipped = []
    if "slots" in free and not cluster.queue_kb:
        free.remove("slots")  # flags only serialize pushes; what they buy is a port queue that does not overflow
        skipped.append("slots: no shard port queue given (--queue-kb), so no incast for flags to avoid")
    current = knobs_of(base, free)
    tried: dict[tuple[tuple[str, str], ...], Trial] = {}

    def predicted(knobs: dict[str, str]) -> Trial:
        key = tuple(sorted(knobs.items()))
        if key not in tried:
            trial = simulate_schedule(profile, cluster, constants, apply(base, knobs), iters)
            tried[key] = dataclasses.replace(trial, knobs=dict(knobs))
            progress(f"{_describe(knobs)}: {tried[key].mean_iteration_s:.4f} s/it")
        return tried[key]

    best = predicted(current)
    for _ in range(MAX_PASSES):
        changed = False
        for knob in free:
            for value in KNOBS[knob]:
                candidate = predicted({**current, knob: value})
                if candidate.mean_iteration_s < best.mean_iteration_s * (1 - MARGIN):
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


def _describe(knobs: Mapping[str, str]) -> str:
    return ", ".join(f"{knob} {value}" for knob, value in knobs.items())


def explain_markdown(report: TuningReport) -> str:
    """The decision, the runner-up and every candidate simulated, as ``imerge simulate --explain`` prints it."""
    chosen, runner_up = report.chosen, report.runner_up
    lines = [f"{report.model}, {report.workers} workers, {report.shards} shards, links {report.link_gbit:g} Gbit/s: "
             f"chosen {_describe(chosen.knobs) or 'the given schedule'}, predicted {chosen.mean_iteration_s:.4f} s/it"]
    if runner_up is not None:
        lines.append(f"runner-up {_describe(runner_up.knobs)}, predicted {runner_up.mean_iteration_s:.4f} s/it "
                     f"({runner_up.mean_iteration_s / chosen.mean_iteration_s - 1:+.1%})")
    lines.append(f"pinned by flags: {', '.join(report.pinned) or 'none'}; decided in {report.decided_in_cpu_s:.1f} "
                 f"CPU s over {len(report.trials)} simulations")
    lines += [f"not tried: {reason}" for reason in report.skipped]
    knobs = list(chosen.knobs)
    lines += ["", "| " + " | ".join(knobs) + " | predicted s/it | x chosen |", "|" + "---|" * (len(knobs) + 2)]
    for trial in report.trials:
        lines.append("| " + " | ".join(trial.knobs[k] for k in knobs) +
                     f" | {trial.mean_iteration_s:.4f} | {trial.mean_iteration_s / chosen.mean_iteration_s:.3f} |")
    return "\n".join(lines) + "\n"
