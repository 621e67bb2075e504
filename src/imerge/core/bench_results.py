"""What ``imerge bench`` measured, typed. Pure.

``results.json`` is the JSON of these (its keys are the fields), written by the
benchmark and read back by the simulator's comparison and calibration; a file
of an older release that lacks a field reads with that field's default.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from imerge.core.errors import ConfigError
from imerge.core.strategies import Scenario

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def _known(cls: type[T], raw: dict[str, Any]) -> T:
    """``cls`` from the JSON fields it has (lists become tuples where the field is a tuple)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: (tuple(v) if isinstance(v, list) and str(fields[k].type).startswith("tuple") else v)
              for k, v in raw.items() if k in fields}
    return cls(**values)


class JsonReport:
    """A report whose JSON is its fields (results.json)."""

    def to_json(self) -> dict[str, Any]:
        raw: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        return raw


def scenario_of(raw: dict[str, Any]) -> Scenario:
    return _known(Scenario, raw)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One strategy's run in one round of the testbed (median and p90 over its timed iterations)."""

    strategy: str
    iteration_s: list[float]
    median_iteration_s: float
    p90_iteration_s: float
    iterations: int = 0
    compute_s: float | None = None          # the workers' median compute per iteration (from their traces)
    exposed_comm_s: float | None = None     # the median wait of a forward for its parameters
    bytes_per_iteration: float = 0.0        # a worker's mean of max(sent, received) per iteration
    worker_bytes_per_iteration: float = 0.0
    shard_bytes_per_iteration: float = 0.0
    link_utilization: float | None = None   # of the measured ports (shards'; DDP: workers')
    link_utilization_per_shard: dict[str, float] = dataclasses.field(default_factory=dict)
    push_p50_ms: float | None = None
    push_p99_ms: float | None = None
    tcp_retransmissions: int = 0            # TCP segments every host of the run retransmitted, summed ...
    tcp_retransmissions_per_host: dict[str, int] = dataclasses.field(default_factory=dict)  # ... and by host
    utilization_series: list[tuple[float, dict[str, int]]] = dataclasses.field(default_factory=list)
    trace_dir: str = ""
    schedule: str = ""                      # what --tune chose (the strategy auto): its knobs, per round
    predicted_s: float | None = None        # ... and the seconds per iteration it predicted (the rounds' mean)
    runner_up: str = ""                     # ... the fastest candidate with other knob values, per round
    runner_up_s: float | None = None        # ... and its prediction (the rounds' mean)
    profile_compute_s: float | None = None  # worker 0's profiled compute per iteration it decided on (rounds' mean)


@dataclasses.dataclass(frozen=True)
class StrategyResult(RunResult):
    """A strategy's rounds merged (the iterations of all rounds), against the scenario's bound and DDP."""

    rounds: int = 1
    bound_s: float = 0.0
    ratio_to_bound: float | None = None
    ratio_to_ddp: float | None = None


def _strategy(name: str, raw: dict[str, Any]) -> StrategyResult:
    """A strategy's result as results.json holds it; a file that lacks its name or its quantiles (a hand-made
    or older one) gets them from its key and its iterations."""
    series = [(float(t), dict(hosts)) for t, hosts in raw.get("utilization_series", [])]  # JSON made them lists
    times = sorted(raw["iteration_s"])
    quantiles = {"median_iteration_s": statistics.median(times),
                 "p90_iteration_s": times[min(len(times) - 1, round(0.9 * (len(times) - 1)))]} if times else {}
    return _known(StrategyResult, {"strategy": name, **quantiles, **raw, "utilization_series": series})


@dataclasses.dataclass(frozen=True)
class BenchReport(JsonReport):
    """Every strategy of one scenario (at one size)."""

    scenario: Scenario
    compute_s: float
    strategies: dict[str, StrategyResult]
    command: str = ""
    name: str = ""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BenchReport:
        return cls(scenario_of(raw["scenario"]), raw.get("compute_s", 0.0),
                   {name: _strategy(name, result) for name, result in raw["strategies"].items()},
                   raw.get("command", ""), raw.get("name", ""))


@dataclasses.dataclass(frozen=True)
class ScalingReport(JsonReport):
    """A scaling scenario (B4): one report per worker count."""

    scenario: Scenario
    sizes: dict[int, BenchReport]
    command: str = ""
    name: str = ""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ScalingReport:
        return cls(scenario_of(raw["scenario"]), {int(k): BenchReport.from_json(v) for k, v in raw["sizes"].items()},
                   raw.get("command", ""), raw.get("name", ""))


def read_results(path: str | Path) -> BenchReport | ScalingReport:
    """The report of a results.json of ``imerge bench`` (a scaling scenario's, or one scenario's)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if "sizes" in raw:
            return ScalingReport.from_json(raw)
        return BenchReport.from_json(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError("measured", f"cannot read {path}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("measured", f"{path} is not the results.json of imerge bench ({exc})") from None
