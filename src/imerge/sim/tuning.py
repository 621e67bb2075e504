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

from imerge.core.knobs import KNOBS, apply, describe, knob_fields, knobs_of
from imerge.core.schedule_config import ScheduleConfig

from .cluster import Cluster, Constants
from .profiles import ModelProfile
from .results import Trial, TuningReport

MARGIN = 0.01     # a candidate replaces the current schedule only if predicted this much faster
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
         progress: Callable[[str], None] = lambda line: None, only: list[str] | None = None) -> TuningReport:
    """The fastest schedule the coordinate descent finds from ``base`` (see the module's docstring); ``only``:
    the knobs it may vary (default: every knob not pinned)."""
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

    def predicted(knobs: dict[str, str]) -> Trial:
        key = tuple(sorted(knobs.items()))
        if key not in tried:
            trial = simulate_schedule(profile, cluster, constants, apply(base, knobs), iters)
            tried[key] = dataclasses.replace(trial, knobs=dict(knobs))
            progress(f"{describe(knobs)}: {tried[key].mean_iteration_s:.4f} s/it")
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


def explain_markdown(report: TuningReport) -> str:
    """The decision, the runner-up and every candidate simulated, as ``imerge simulate --explain`` prints it."""
    chosen, runner_up = report.chosen, report.runner_up
    lines = [f"{report.model}, {report.workers} workers, {report.shards} shards, links {report.link_gbit:g} Gbit/s: "
             f"chosen {describe(chosen.knobs)}, predicted {chosen.mean_iteration_s:.4f} s/it"]
    if runner_up is not None:
        lines.append(f"runner-up {describe(runner_up.knobs)}, predicted {runner_up.mean_iteration_s:.4f} s/it "
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
