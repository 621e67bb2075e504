"""Fit the simulator's constants to testbed runs (``imerge simulate calibrate``, ``imerge bench ... --calibrate``).

Pure. The cases are the strategies of one or more ``results.json`` files of
``imerge bench``; the fit minimizes the root mean square of log(predicted /
measured) mean iteration time by coordinate search: each constant in turn is
tried at a few multiples of its value (the incast efficiency at a few levels,
only if some case has a shallow queue; the ring's CPU per byte and latency only if some
case runs DDP on two or more workers; a flag's round trip only if some case takes
slot flags; the CPU per fp32 byte apart from the CPU per wire byte only if some case
compresses; a sync's CPU per shard only if some PS case runs two or more workers,
where the cores are busy enough to tell fusions apart), the best kept, for a few sweeps. The
shared cores are the calibrating machine's (the testbed's hosts all run on
it). Check a calibration on runs it was not fitted to (``imerge simulate
B1 --measured ... --calibration ...``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from imerge.core.schedule_config import ScheduleConfig
from imerge.core.strategies import INCAST, STRATEGIES

from .cluster import Constants
from .profiles import measured
from .results import FitRow
from .runner import simulate_one
from .testbed import measured_mean, measured_runs, scenario_cluster

FITTED = ("latency_s", "cpu_per_byte", "compute_cores", "step_s_per_byte")
START = Constants(latency_s=2e-4, flag_rtt_s=3e-4, incast_efficiency=1.0, cpu_per_byte=1e-8,
                  dense_cpu_per_byte=2e-9, ring_cpu_per_byte=4e-9, compute_cores=1.5, step_s_per_byte=1e-9,
                  topk_cpu_per_byte=5.3e-9,  # imerge bench compression's measurement, kept, not fitted
                  sync_cpu_s=1e-3)
MULTIPLES = (0.25, 0.5, 2.0, 4.0)
INCAST_LEVELS = (0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
LIMITS = {"compute_cores": (0.5, 4.0)}  # and at most the shared cores: one worker alone cannot use more
FINE = (0.6, 0.8, 1.25, 1.6)
POOLED = 6  # cases from which the fit runs them in a process pool  # a second search, from a first one's result


@dataclasses.dataclass(frozen=True)
class Case:
    scenario: Any
    workers: int
    strategy: str
    measured_s: float


def cases_of(paths: list[str], strategies: set[str] | None = None) -> list[Case]:
    cases = []
    for path in paths:
        for scenario, results in measured_runs(path):
            for name, result in results.items():
                if strategies is None or name in strategies:
                    cases.append(Case(scenario, scenario.workers, name, measured_mean(result)))
    return cases


def predict(case: Case, constants: Constants, iters: int = 0) -> float:
    """The simulated mean s/it of a case, over as many iterations as it ran (``iters``: that many instead)."""
    profile = measured(case.scenario.model)
    cluster = scenario_cluster(case.scenario, case.workers)
    return simulate_one(case.strategy, profile, cluster, constants, iters or case.scenario.iters,
                        ScheduleConfig()).mean_iteration_s


def loss(cases: list[Case], constants: Constants, iters: int, pool: concurrent.futures.Executor | None = None) -> float:
    predicted = (pool.map if pool else map)(predict, cases, [constants] * len(cases), [iters] * len(cases))
    return math.sqrt(statistics.fmean(math.log(p / c.measured_s) ** 2 for p, c in zip(predicted, cases)))


def fit(cases: list[Case], iters: int = 0, sweeps: int = 2, cores: float = 0.0,
        progress: Callable[[str], None] = lambda line: None, start: Constants = START,
        multiples: tuple[float, ...] = MULTIPLES) -> tuple[Constants, float]:
    """The constants that fit ``cases`` best, and their loss (RMS of the log error); the search starts at
    ``start`` and tries each constant at ``multiples`` of its value."""
    best = dataclasses.replace(start, cores=cores or float(os.cpu_count() or 1))
    if len(cases) < POOLED:  # a few cases: starting the processes would cost more than it saves
        return _search(cases, iters, sweeps, best, multiples, progress, None)
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        return _search(cases, iters, sweeps, best, multiples, progress, pool)


def _search(cases: list[Case], iters: int, sweeps: int, best: Constants, multiples: tuple[float, ...],
            progress: Callable[[str], None], pool: concurrent.futures.Executor | None) -> tuple[Constants, float]:
    best_loss = loss(cases, best, iters, pool)
    progress(f"start: loss {best_loss:.3f}")
    names = fitted_names(cases)
    for sweep in range(sweeps):
        for name in names:
            value = getattr(best, name)
            candidates = INCAST_LEVELS if name == "incast_efficiency" else [value * m for m in multiples]
            low, high = LIMITS.get(name, (0.0, math.inf))
            if name == "compute_cores":
                high = min(high, best.cores)
            for candidate in candidates:
                if candidate == value or not low <= candidate <= high:
                    continue
                trial = dataclasses.replace(best, **{name: candidate})
                trial_loss = loss(cases, trial, iters, pool)
                if trial_loss < best_loss:
                    best, best_loss = trial, trial_loss
            progress(f"sweep {sweep + 1}, {name} = {getattr(best, name):.3g}: loss {best_loss:.3f}")
    return best, best_loss


def fitted_names(cases: list[Case]) -> list[str]:
    """The constants the cases can tell: the ring's only with a DDP case of two or more workers, the incast
    efficiency only with a shallow port queue."""
    names = list(FITTED)
    if any(STRATEGIES.get(c.strategy, {}).get("compression", "none") != "none" for c in cases):
        names.append("dense_cpu_per_byte")  # compressed pushes tell the cost per wire byte from that per fp32 byte
    if any(c.strategy == "ddp" and c.workers > 1 for c in cases):
        names += ["ring_cpu_per_byte", "ring_latency_s"]
    if any(c.strategy != "ddp" and c.workers > 1 for c in cases):
        names.append("sync_cpu_s")  # a sync's cost per shard: it tells fusions apart where the cores are busy
    if any(c.scenario.shard_queue_kb for c in cases):
        names.append("incast_efficiency")
    if any({**STRATEGIES, **INCAST}.get(c.strategy, {}).get("slots", "off") != "off" and c.workers > 1
           for c in cases):
        names.append("flag_rtt_s")  # a flag's turn: Redis and, on shared cores, the scheduling of its processes
    return names


def fit_table(cases: list[Case], constants: Constants, iters: int = 0) -> list[FitRow]:
    rows = []
    for case in cases:
        predicted = predict(case, constants, iters)
        rows.append(FitRow(case.scenario.model, case.workers, case.strategy, case.measured_s, predicted,
                           predicted / case.measured_s - 1))
    return rows


def fit_markdown(constants: Constants, fit_loss: float, rows: list[FitRow]) -> str:
    lines = ["Fitted constants (RMS log error %.3f):" % fit_loss, "",
             "| constant | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in dataclasses.asdict(constants).items()]
    lines += ["", "| model | W | strategy | measured mean s/it | fitted s/it | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.scenario} | {r.workers} | {r.strategy} | {r.measured_s:.3f} | {r.predicted_s:.3f} "
              f"| {r.error:+.0%} |" for r in rows]
    return "\n".join(lines) + "\n"
