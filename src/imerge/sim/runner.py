"""``imerge simulate``: every strategy of one job on a simulated cluster, reported as ``imerge bench`` reports.

The columns are the benchmark's: median iteration time, exposed communication,
bytes per worker and iteration, ``x bound`` (the ratio to ``max(compute,
M / rate, W M / (S rate))`` for a PS and ``max(compute, 2 (W - 1) / W x M /
rate)`` for DDP, M the model's bytes) and ``x ddp``, both taken of the mean iteration time (with T > 1 the
median picks either a local step or a sync; the mean is what the job's throughput sees).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from imerge.core.config import option, require
from imerge.core.errors import ConfigError
from imerge.core.schedule_config import ScheduleConfig
from imerge.core.strategies import INCAST, SCENARIOS, SCHEDULES, STRATEGIES, untimed_iterations, warmup_iterations

from .cluster import GBIT, Cluster, Constants
from .ddp import DDPJob, ring_bytes
from .profiles import MEASURED, SYNTHETIC, ModelProfile, measured, synthetic
from .results import SimReport, SimRun

PRESETS = {**STRATEGIES, **INCAST}  # every named strategy: the benchmark's and B3's slot variants
SWEEPS = ("bound", "incast", "period", "cores")  # imerge simulate projections
TARGETS = ("job", *[name for name in SCENARIOS if name != "tiny"], "projections", "calibrate")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    model: str = option("resnet50-like", "the model: a built-in job's measured profile (resnet18, vgg) or a standard "
                                         "architecture (resnet18-like, resnet50-like, vgg16-like, transformer-like)")
    profile: str = option("", "a profile written by imerge worker --profile-out (overrides --model)")
    batch_size: int = option(32, "samples per worker and iteration (the standard architectures)")
    device_tflops: float = option(25.0, "sustained FLOP rate of a worker's device, TFLOP/s (the standard "
                                        "architectures: a backward costs twice its forward)")
    compute_s: float = option(0.0, "scale the profile so that forward plus backward take this long (0: as profiled)")
    workers: int = option(8, "workers W")
    shards: int = option(0, "shards S (0: as many as workers)")
    link_gbit: float = option(10.0, "every worker's link, Gbit/s (full duplex)")
    shard_gbit: float = option(0.0, "every shard's link, Gbit/s (0: --link-gbit)")
    queue_kb: float = option(0.0, "the switch port queue in front of each shard, kB (0: deep, no incast loss)")
    mtu: int = option(9000, "packet size, bytes (with --queue-kb: packets a queue holds)")
    shard_cores: float = option(1.0, "cores each shard host's data path uses: its shard processes or threads, each "
                                     "spending the measured CPU per byte (0: the data path's CPU is not counted)")
    worker_cores: float = option(1.0, "cores each worker's data path uses (0: its CPU is not counted)")
    iters: int = option(30, "iterations simulated (the first few are warm-up and profile, not timed)")
    strategies: str = option("", "comma-separated strategies (default: every one without compression)")
    calibration: str = option("", "constants fitted on a testbed (imerge bench ... --calibrate, or imerge simulate "
                                  "calibrate); default: a cluster of real hosts, or for B1..B4 this project's testbed")
    measured: str = option("", "B1..B4: the results.json of imerge bench to put beside the prediction")
    runs: str = option("", "calibrate: comma-separated results.json files of imerge bench to fit the constants to "
                           "(PATH#1+2: only the runs at 1 and 2 workers)")
    sweeps: str = option("", f"projections: comma-separated sweeps of {', '.join(SWEEPS)} (default: all)")
    explain: bool = option(False, "job: choose the schedule by simulating candidates (every scheduling knob that no "
                                  "flag pins), print what was chosen, the runner-up and every candidate, and the "
                                  "chosen schedule beside the strategies as 'auto'")
    out: str = option("", "output folder (default: runs/simulate-<target>-<time>)")
    budget_s: float = option(60.0, "job: seconds the simulations may take; a strategy whose estimated simulation "
                                   "would take the run past them is left out, and the report says so (0: no limit)")

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", "must be at least 1")
        require(self.device_tflops > 0, "device_tflops", "must be positive")
        require(self.compute_s >= 0, "compute_s", "must be >= 0")
        require(1 <= self.workers <= 1 << 16, "workers", "must lie in 1..65536")
        require(0 <= self.shards <= 1 << 16, "shards", "must lie in 0..65536 (0: as many as workers)")
        require(self.link_gbit > 0, "link_gbit", "must be positive")
        require(self.shard_gbit >= 0, "shard_gbit", "must be >= 0 (0: --link-gbit)")
        require(self.queue_kb >= 0, "queue_kb", "must be >= 0")
        require(576 <= self.mtu <= 65000, "mtu", "must lie in 576..65000")
        require(0 <= self.shard_cores <= 4096, "shard_cores", "must lie in 0..4096 (0: not counted)")
        require(0 <= self.worker_cores <= 4096, "worker_cores", "must lie in 0..4096 (0: not counted)")
        require(self.iters >= 3, "iters", "must be at least 3")
        require(self.budget_s >= 0, "budget_s", "must be >= 0 (0: no limit)")
        require(not self.profile or Path(self.profile).is_file(), "profile", f"{self.profile}: no such file")
        require(not self.calibration or Path(self.calibration).is_file(), "calibration",
                f"{self.calibration}: no such file")
        require(not self.measured or Path(self.measured).is_file(), "measured", f"{self.measured}: no such file")
        self.sweeps_chosen()

    def sweeps_chosen(self) -> tuple[str, ...]:
        names = tuple(s.strip() for s in self.sweeps.split(",") if s.strip()) or SWEEPS
        unknown = [n for n in names if n not in SWEEPS]
        if unknown:
            raise ConfigError("sweeps", f"{', '.join(unknown)} not in {', '.join(SWEEPS)}")
        return names

    def chosen(self, default: tuple[str, ...] = SCHEDULES) -> list[str]:
        names = [s.strip() for s in self.strategies.split(",") if s.strip()] or list(default)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise ConfigError("strategies", f"{', '.join(unknown)} not in {', '.join(PRESETS)}")
        return names

    def load_profile(self) -> ModelProfile:
        if self.profile:
            profile = ModelProfile.read(self.profile)
        elif self.model in MEASURED:
            profile = measured(self.model)
        elif self.model in SYNTHETIC:
            profile = synthetic(self.model, self.batch_size, self.device_tflops)
        else:
            raise ConfigError("model", f"unknown model {self.model!r}; choose from "
                                       f"{', '.join([*MEASURED, *SYNTHETIC])} or give --profile FILE")
        return profile.scaled(self.compute_s) if self.compute_s else profile

    def cluster(self) -> Cluster:
        return Cluster(self.workers, self.shards or self.workers, self.link_gbit, self.shard_gbit or self.link_gbit,
                       self.queue_kb, self.mtu, self.shard_cores, self.worker_cores)

    def constants(self, default: Constants = Constants()) -> Constants:
        return Constants.read(self.calibration) if self.calibration else default


def strategy_schedule(name: str, base: ScheduleConfig = ScheduleConfig()) -> ScheduleConfig:
    """The scheduler's options of strategy ``name``: its preset over ``base``."""
    options = PRESETS[name]
    try:
        return dataclasses.replace(base, **options)
    except ConfigError as exc:
        raise ConfigError(exc.option, f"strategy {name}: {exc}") from None


def simulate_one(name: str, profile: ModelProfile, cluster: Cluster, constants: Constants, iters: int,
                 base: ScheduleConfig = ScheduleConfig(), schedule: ScheduleConfig | None = None) -> SimRun:
    """One strategy on one cluster (``schedule``: the strategy's options, where ``name`` is not a preset): the
    simulated result (and how long the simulation took)."""
    from .psjob import PSJob  # simpy and the job model load only when a job is simulated

    started = time.perf_counter()
    warmup = warmup_iterations(iters)  # as the benchmark: the warm-up is fusion cost's profile too
    if name == "ddp":
        result = DDPJob(profile, cluster, constants, iters, 2).run()
    else:
        if schedule is None and name == "auto":  # what the job's --tune would choose on this profile and cluster
            schedule = job_choice(profile, cluster, constants, base)
        options = strategy_schedule(name, base) if schedule is None else schedule
        result = PSJob(profile, cluster, constants, dataclasses.replace(options, profile_iters=max(2, warmup)),
                       iters, untimed_iterations(iters)).run()
    return dataclasses.replace(result, strategy=name, simulated_in_s=time.perf_counter() - started)


def job_choice(profile: ModelProfile, cluster: Cluster, constants: Constants, base: ScheduleConfig) -> ScheduleConfig:
    """The schedule a job's ``--tune`` chooses for ``profile`` on ``cluster``: the job knobs ``base`` leaves free
    (the fields that differ from their defaults pin theirs), found by the tuner."""
    from .tuning import chosen_schedule, tune

    fixed = dataclasses.replace(base, tune="none")
    return chosen_schedule(tune(profile, cluster, constants, fixed, only=base.tuned_knobs), fixed)


def bounds(profile: ModelProfile, cluster: Cluster, compute_s: float | None = None) -> tuple[float, float]:
    """The physical bound of a PS iteration and of a DDP one (the benchmark's formulas)."""
    compute = profile.compute_s if compute_s is None else compute_s
    model = profile.nbytes
    ps = max(model / (cluster.worker_gbit * GBIT), cluster.workers * model / (cluster.shards * cluster.shard_gbit * GBIT))
    ring = ring_bytes(model, cluster.workers) / (cluster.worker_gbit * GBIT)
    return max(compute, ps), max(compute, ring)


def simulate(profile: ModelProfile, cluster: Cluster, constants: Constants, names: list[str], iters: int,
             base: ScheduleConfig = ScheduleConfig(), schedules: dict[str, ScheduleConfig] | None = None,
             budget_s: float = 0.0, say: Callable[[str], None] = lambda line: None) -> SimReport:
    """Every strategy in ``names`` (and each of ``schedules``, by its name) on one cluster, with the bound and the
    ratio to DDP; within ``budget_s`` seconds (0: no limit), the strategies left out named in the report
    (:mod:`.budget`); progress through ``say``."""
    from .budget import within_budget
    from .psjob import lane_positions
    from .tuning import BUDGET_CPU_S

    chosen = {name: schedules[name] if schedules and name in schedules else None
              for name in [*names, *(schedules or {})]}

    def classes(name: str) -> int:
        if name == "ddp":
            return 0
        schedule = chosen[name] or (base if name == "auto" else strategy_schedule(name, base))
        return len(lane_positions(schedule, cluster))

    results, skipped = within_budget(
        list(chosen), classes, lambda name: simulate_one(name, profile, cluster, constants, iters, base, chosen[name]),
        budget_s, say, lambda name: BUDGET_CPU_S if name == "auto" and chosen[name] is None else 0.0)
    ps_bound, ddp_bound = bounds(profile, cluster)
    ddp_s = results["ddp"].mean_iteration_s if "ddp" in results else None
    for name, result in results.items():
        bound = ddp_bound if name == "ddp" else ps_bound
        results[name] = dataclasses.replace(result, bound_s=bound, ratio_to_bound=result.mean_iteration_s / bound,
                                            ratio_to_ddp=result.mean_iteration_s / ddp_s if ddp_s else None)
    return SimReport(profile.name, profile.nbytes, profile.compute_s, cluster, constants, iters, results, skipped)


COLUMNS = [("mean_iteration_s", "mean s/it", "{:.3f}"), ("median_iteration_s", "median s/it", "{:.3f}"), ("exposed_comm_s", "exposed comm s", "{:.3f}"),
           ("bytes_per_iteration", "MB/it/worker", "{:.2f}"), ("ratio_to_bound", "x bound", "{:.2f}"),
           ("ratio_to_ddp", "x ddp", "{:.2f}"), ("simulated_in_s", "simulated in s", "{:.1f}")]


def _cell(value: Any, fmt: str, key: str) -> str:
    if value is None or value != value:
        return "-"
    return fmt.format(value / 1e6 if key == "bytes_per_iteration" else value)


def markdown(report: SimReport) -> str:
    cluster = report.cluster
    lines = [f"{report.model} ({report.model_bytes / 1e6:.1f} MB), {cluster.workers} workers, "
             f"{cluster.shards} shards, links {cluster.worker_gbit:g} Gbit/s (shards {cluster.shard_gbit:g})"
             + (f", data path cores: shard host {cluster.shard_cores:g}, worker {cluster.worker_cores:g}"
                if not report.constants.cores else "")
             + (f", shard port queue {cluster.queue_kb:g} kB" if cluster.queue_kb else "")
             + f"; compute {report.compute_s:.3f} s per iteration; {report.iters} iterations simulated.", "",
             "| strategy | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for name, result in report.strategies.items():
        lines.append(f"| {name} | " + " | ".join(_cell(getattr(result, k), f, k) for k, _, f in COLUMNS) + " |")
    if report.skipped:
        lines += ["", *[f"* {name}: {why}" for name, why in report.skipped.items()]]
    return "\n".join(lines) + "\n"
