"""The benchmark scenarios (B1..B4) simulated, beside what ``imerge bench`` measured on the testbed. Pure.

A scenario's model is the built-in job's, with the profile measured once on
this project's machine (``share/resnet18.json``, ``share/vgg.json``: one
worker alone, batch 8); the cluster is the testbed's (every host behind a
shaped link, the shard port queue of B3); the constants are a calibration's
(default: ``share/testbed.json``, fitted by ``imerge simulate calibrate`` on
the testbed runs named in ``docs/scaling.md``). The testbed's hosts share this
machine's cores, which the calibration's ``cores`` says.

A measured iteration time is the mean over the timed iterations (the
benchmark's warm-up and profile left out, as it does): with T > 1 the median
of a run alternates between a local step and a sync, the mean is what a job's
throughput sees.
"""
from __future__ import annotations

import dataclasses
import statistics
from importlib import resources
from pathlib import Path

from imerge.core.bench_results import ScalingReport, StrategyResult, read_results
from imerge.core.errors import ConfigError
from imerge.core.schedule_config import ScheduleConfig
from imerge.core.strategies import SCENARIOS, Scenario

from .cluster import Cluster, Constants
from .profiles import measured
from .results import ComparisonReport, SimRun
from .runner import simulate


def testbed_constants() -> Constants:
    """The calibration of this project's testbed that ships with the package."""
    return Constants.read(str(resources.files("imerge.sim").joinpath("share", "testbed.json")))


def scenario_cluster(scenario: Scenario, workers: int | None = None) -> Cluster:
    """The testbed of a benchmark scenario as a cluster (B4: shards = workers)."""
    workers = workers or scenario.workers
    shards = workers if scenario.sizes else scenario.shards
    rate = scenario.rate_mbit / 1000
    return Cluster(workers, shards, rate, rate, scenario.shard_queue_kb, scenario.mtu)


def measured_runs(path: str | Path) -> list[tuple[Scenario, dict[str, StrategyResult]]]:
    """The (scenario, strategy results) pairs of a results.json of ``imerge bench`` (B4: one per size; ``PATH#1+2``
    takes only the sizes 1 and 2)."""
    path, _, picked = str(path).partition("#")
    if picked:
        try:
            sizes = {int(part) for part in picked.split("+")}
        except ValueError:
            raise ConfigError("runs", f"{path}#{picked}: after # come worker counts joined by +, e.g. #1+2") from None
        return [(s, r) for s, r in measured_runs(path) if s.workers in sizes]
    report = read_results(path)
    if isinstance(report, ScalingReport):
        return [(sized.scenario, sized.strategies) for sized in report.sizes.values()]
    return [(report.scenario, report.strategies)]


def measured_mean(result: StrategyResult) -> float:
    return statistics.fmean(result.iteration_s)


def simulate_scenario(name: str, names: list[str], constants: Constants, iters: int,
                      base: ScheduleConfig = ScheduleConfig(), measured_path: str = "",
                      sizes: tuple[int, ...] = ()) -> ComparisonReport:
    """Scenario ``name`` at each of its sizes: the simulation, and beside it the measurement when given."""
    if name not in SCENARIOS:
        raise ConfigError("target", f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    scenario = SCENARIOS[name]
    profile = measured(scenario.model)
    runs = {s.workers: (s, results) for s, results in measured_runs(measured_path)} if measured_path else {}
    if runs and not sizes:
        sizes = tuple(sorted(runs))
    sizes = sizes or scenario.sizes or (scenario.workers,)
    reports = {}
    for workers in sizes:
        sized, results = runs.get(workers, (scenario, {}))
        # beside a measurement, as many iterations as it ran: the warm-up, the profile and the short first
        # iteration after the cost plan's switch weigh the same in both means
        report = simulate(profile, scenario_cluster(sized, workers), constants, names,
                          sized.iters if results else iters, base)
        beside = {strategy: _beside(result, results[strategy]) for strategy, result in report.strategies.items()
                  if strategy in results}
        reports[workers] = dataclasses.replace(report, strategies={**report.strategies, **beside})
    return ComparisonReport(name, profile.name, reports)


def _beside(simulated: SimRun, measured_run: StrategyResult) -> SimRun:
    mean = measured_mean(measured_run)
    return dataclasses.replace(simulated, measured_mean_s=mean, measured_median_s=measured_run.median_iteration_s,
                               error=simulated.mean_iteration_s / mean - 1)


def comparison_markdown(report: ComparisonReport) -> str:
    """Predicted against measured, one row per strategy, one column group per worker count."""
    sizes = list(report.sizes)
    first = report.sizes[sizes[0]]
    cluster = first.cluster
    lines = [f"{report.scenario}: {report.model}, {cluster.shards} shards"
             + (" (= workers)" if len(sizes) > 1 else f", {cluster.workers} workers")
             + f", {cluster.worker_gbit * 1000:g} Mbit/s links"
             + (f", shard port queue {cluster.queue_kb:g} kB" if cluster.queue_kb else "")
             + ". Each cell: predicted / measured mean s/it (error).", "",
             "| strategy | " + " | ".join(f"W={w}" for w in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for strategy in first.strategies:
        cells = []
        for workers in sizes:
            result = report.sizes[workers].strategies.get(strategy)
            if result is not None and result.measured_mean_s is not None and result.error is not None:
                cells.append(f"{result.mean_iteration_s:.2f} / {result.measured_mean_s:.2f} ({result.error:+.0%})")
            elif result is not None:
                cells.append(f"{result.mean_iteration_s:.2f} / -")
            else:
                cells.append("-")
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    errors = [abs(r.error) for s in report.sizes.values() for r in s.strategies.values() if r.error is not None]
    if errors:
        within = sum(e <= 0.15 for e in errors)
        lines += ["", f"{within} of {len(errors)} within 15%; mean absolute error {statistics.fmean(errors):.1%}, "
                      f"largest {max(errors):.1%}."]
    return "\n".join(lines) + "\n"
