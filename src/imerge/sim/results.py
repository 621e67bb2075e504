"""What the simulator predicts, typed; each report's JSON (results.json) is its fields. Pure."""
from __future__ import annotations

import dataclasses

from imerge.core.bench_results import JsonReport

from .cluster import Cluster, Constants


@dataclasses.dataclass(frozen=True)
class SimRun:
    """One strategy simulated on one cluster: its timed iterations (after the warm-up) and what they moved."""

    iteration_s: list[float]
    median_iteration_s: float
    mean_iteration_s: float
    exposed_comm_s: float | None     # the mean forward wait (DDP: not modelled)
    bytes_per_iteration: float       # a worker's busier direction
    elapsed_s: float = 0.0           # simulated time of the whole run
    worker_classes: int = 1          # workers simulated apart (the others behave as one of these)
    shard_classes: int = 0
    groups: int = 0
    strategy: str = ""
    simulated_in_s: float = 0.0      # wall time the simulation took
    bound_s: float = 0.0
    ratio_to_bound: float | None = None
    ratio_to_ddp: float | None = None
    measured_mean_s: float | None = None    # beside a measurement of the testbed
    measured_median_s: float | None = None
    error: float | None = None              # simulated mean over measured mean, minus 1


@dataclasses.dataclass(frozen=True)
class SimReport(JsonReport):
    """Every strategy on one cluster."""

    model: str
    model_bytes: int
    compute_s: float
    cluster: Cluster
    constants: Constants
    iters: int
    strategies: dict[str, SimRun]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # strategy -> why it was not simulated


@dataclasses.dataclass(frozen=True)
class ComparisonReport(JsonReport):
    """A benchmark scenario simulated at each of its worker counts, beside its measurement where given."""

    scenario: str
    model: str
    sizes: dict[int, SimReport]


@dataclasses.dataclass(frozen=True)
class Task:
    """One simulation of the projections: a sweep's strategy on a cluster."""

    sweep: str
    model: str
    workers: int
    shards: int
    link_gbit: float
    strategy: str
    queue_kb: float = 0.0
    period: int = 1
    shard_cores: float = 0.0   # 0: the data path's CPU is not counted
    worker_cores: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProjectionRow(Task):
    """One cell of the projections: a task (a strategy on a cluster), simulated."""

    mean_iteration_s: float = 0.0
    bytes_per_iteration: float = 0.0
    bound_s: float = 0.0
    ratio_to_bound: float = 0.0
    compute_s: float = 0.0
    model_bytes: int = 0
    simulated_in_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProjectionReport(JsonReport):
    iters: int
    batch_size: int
    device_tflops: float
    constants: Constants
    rows: list[ProjectionRow]
    plots: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class FitRow:
    """A measured case against the fitted simulator."""

    scenario: str   # the scenario's model
    workers: int
    strategy: str
    measured_s: float
    predicted_s: float
    error: float


@dataclasses.dataclass(frozen=True)
class CalibrationReport(JsonReport):
    constants: Constants
    loss: float
    cases: list[FitRow]
    runs: list[str]


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate simulated: its knob values and its predicted mean iteration time."""

    knobs: dict[str, str]
    mean_iteration_s: float
    exposed_comm_s: float | None


@dataclasses.dataclass(frozen=True)
class TuningReport(JsonReport):
    """What the tuner decided for one job and cluster, and every candidate it simulated, fastest first."""

    model: str
    workers: int
    shards: int
    link_gbit: float
    pinned: list[str]          # knobs the user's flags fixed
    chosen: Trial
    runner_up: Trial | None    # the fastest candidate with other knob values
    trials: list[Trial]
    decided_in_cpu_s: float    # the CPU time the decision took (all its simulations)
    skipped: list[str] = dataclasses.field(default_factory=list)  # knobs not varied, and why


@dataclasses.dataclass(frozen=True)
class ExplainReport(JsonReport):
    """``imerge simulate --explain``: the tuner's decision and the chosen schedule beside the strategies."""

    tuning: TuningReport
    job: SimReport
