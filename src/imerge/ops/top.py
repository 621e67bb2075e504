"""``imerge top``: a live terminal view of a running job, read from its /metrics endpoints.

For users without Grafana: the same figures as the dashboards (shard load and
link utilization, where each worker's iteration goes, the scheduler's flags),
computed from two scrapes ``--interval-s`` apart.
"""
from __future__ import annotations

import dataclasses
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table

from imerge.core.config import option, require
from imerge.core.errors import IMergeError

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclasses.dataclass(frozen=True)
class TopConfig:
    targets: str = option("", "comma-separated host:port of the job's /metrics endpoints")
    prometheus_config: str = option("", "read the targets from this prometheus.yml (imerge launch writes one "
                                        "in its log folder)")
    interval_s: float = option(2.0, "seconds between two scrapes (the window of every rate)")
    scrape_timeout_s: float = option(2.0, "timeout of one scrape")
    once: bool = option(False, "render one frame and exit (non-interactive)")

    def __post_init__(self) -> None:
        require(self.interval_s > 0, "interval_s", "must be positive")
        require(self.scrape_timeout_s > 0, "scrape_timeout_s", "must be positive")
        require(bool(self.targets) != bool(self.prometheus_config), "targets",
                "give either --targets or --prometheus-config")

    def target_list(self) -> dict[str, str]:
        """Role (or address) -> host:port."""
        if self.targets:
            return {t.strip(): t.strip() for t in self.targets.split(",") if t.strip()}
        try:
            config = yaml.safe_load(Path(self.prometheus_config).read_text())
            found = {(c.get("labels") or {}).get("role", t): t for job in config["scrape_configs"]
                     for c in job.get("static_configs") or [] for t in c["targets"]}
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise IMergeError(f"--prometheus-config {self.prometheus_config}: cannot read the static_configs "
                              f"targets of its scrape_configs: {problem}") from None
        if not found:
            raise IMergeError(f"--prometheus-config {self.prometheus_config}: no static_configs targets (a "
                              "configuration with service discovery only: give --targets host:port,...)")
        return found


def scrape(address: str, timeout_s: float) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_all(targets: dict[str, str], timeout_s: float) -> tuple[Samples, list[str]]:
    """Every target's samples, merged (each keeps an ``instance`` label), and the targets that failed."""
    merged: Samples = {}
    down = []
    for role, address in targets.items():
        try:
            samples = scrape(address, timeout_s)
        except (OSError, urllib.error.URLError, ValueError):
            down.append(role)
            continue
        merged.update({(name, labels + (("instance", address),)): v for (name, labels), v in samples.items()})
    return merged, down


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Sum of ``name`` per value of ``label``."""
    out: dict[str, float] = defaultdict(float)
    for (metric, labels), value in samples.items():
        if metric == name:
            out[dict(labels).get(label, "")] += value
    return out


def _capacity(samples: Samples) -> dict[str, float]:
    return {dict(labels)["instance"]: v for (m, labels), v in samples.items()
            if m == "imerge_link_capacity_bytes_per_second"}


class Frame:
    """The figures of one interval between two scrapes."""

    def __init__(self, before: Samples, after: Samples, seconds: float):
        self.before, self.after, self.seconds = before, after, seconds

    def rate(self, name: str, label: str) -> dict[str, float]:
        first, last = _by(self.before, name, label), _by(self.after, name, label)
        return {key: max(0.0, last[key] - first.get(key, 0.0)) / self.seconds for key in last}

    def mean(self, histogram: str, label: str) -> dict[str, float | None]:
        sums, counts = self.rate(f"{histogram}_sum", label), self.rate(f"{histogram}_count", label)
        return {key: (sums[key] / counts[key] if counts.get(key) else None) for key in sums}

    def link_capacity(self, name: str, label: str) -> dict[str, float]:
        """Link capacity of the instance that exports ``name`` for each ``label`` value."""
        capacity = _capacity(self.after)
        return {dict(labels).get(label, ""): capacity.get(dict(labels)["instance"], 0.0)
                for (metric, labels) in self.after if metric == name}


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}{suffix}"


def shard_table(frame: Frame) -> tuple[Table, dict[str, float]]:
    received = frame.rate("imerge_shard_received_bytes_total", "shard")
    sent = frame.rate("imerge_shard_sent_bytes_total", "shard")
    capacity = frame.link_capacity("imerge_shard_received_bytes_total", "shard")
    rounds = frame.rate("imerge_shard_rounds_total", "shard")
    in_flight = _by(frame.after, "imerge_shard_pushes_in_flight", "shard")
    planned = _by(frame.after, "imerge_shard_planned_bytes", "shard")
    table = Table(title="shards")
    for column in ("shard", "received MB/s", "sent MB/s", "link util", "pushes in flight", "planned MB",
                   "rounds/s"):
        table.add_column(column, justify="right")
    busiest: dict[str, float] = {}
    for shard in sorted(received, key=int):
        busiest[shard] = max(received[shard], sent.get(shard, 0.0))
        util = busiest[shard] / capacity[shard] if capacity.get(shard) else None
        table.add_row(shard, _fmt(received[shard], 1e6, 2), _fmt(sent.get(shard), 1e6, 2),
                      _fmt(util, 0.01, 1, "%"), f"{in_flight.get(shard, 0):.0f}", _fmt(planned.get(shard), 1e6, 2),
                      _fmt(rounds.get(shard), 1, 1))
    return table, busiest


def worker_table(frame: Frame) -> Table:
    iteration = frame.mean("imerge_worker_iteration_seconds", "worker")
    compute = frame.mean("imerge_worker_compute_seconds", "worker")
    waited = frame.mean("imerge_worker_forward_wait_seconds", "worker")
    flag = frame.mean("imerge_worker_flag_wait_seconds", "worker")
    pushed = frame.rate("imerge_worker_pushed_bytes_total", "worker")
    samples = frame.rate("imerge_worker_samples_total", "worker")
    iterations = _by(frame.after, "imerge_worker_iterations_total", "worker")
    table = Table(title="workers")
    for column in ("worker", "iterations", "s/it", "compute s", "exposed comm s", "flag wait s", "pushed MB/s",
                   "samples/s"):
        table.add_column(column, justify="right")
    for worker in sorted(iterations, key=int):
        table.add_row(worker, f"{iterations[worker]:.0f}", _fmt(iteration.get(worker)), _fmt(compute.get(worker)),
                      _fmt(waited.get(worker)), _fmt(flag.get(worker)), _fmt(pushed.get(worker), 1e6, 2),
                      _fmt(samples.get(worker), 1, 1))
    return table


def job_line(frame: Frame, shard_bytes_per_s: dict[str, float], down: list[str]) -> str:
    after = frame.after
    plan = next((v for (m, _), v in after.items() if m == "imerge_coordinator_plan_version"), None)
    members = {role: next((v for (m, _), v in after.items() if m == f"imerge_coordinator_live_{role}s"), 0.0)
               for role in ("worker", "shard")}
    flags = {k: next((v for (m, _), v in after.items() if m == f"imerge_coordinator_flags_{k}_total"), None)
             for k in ("granted", "contended", "expired")}
    iteration = [v for v in frame.mean("imerge_worker_iteration_seconds", "worker").values() if v]
    compute = [v for v in frame.mean("imerge_worker_compute_seconds", "worker").values() if v]
    iterations_per_s = max(frame.rate("imerge_worker_iterations_total", "worker").values(), default=0.0)
    capacity = min(_capacity(after).values(), default=0.0)
    shard_link_s = (max(shard_bytes_per_s.values(), default=0.0) / iterations_per_s / capacity
                    if iterations_per_s and capacity else 0.0)
    bound = max(max(compute, default=0.0), shard_link_s)
    efficiency = bound / max(iteration) if iteration and bound else None
    samples = sum(frame.rate("imerge_worker_samples_total", "worker").values())
    return (f"plan v{_fmt(plan, 1, 0)} | live workers {members.get('worker', 0):.0f}, shards "
            f"{members.get('shard', 0):.0f} | flags granted {_fmt(flags['granted'], 1, 0)}, contended "
            f"{_fmt(flags['contended'], 1, 0)}, expired {_fmt(flags['expired'], 1, 0)} | {samples:.1f} samples/s"
            f" | efficiency against the bound {_fmt(efficiency, 0.01, 0, '%')}"
            + (f" | down: {', '.join(down)}" if down else ""))


def render(frame: Frame, down: list[str]) -> Group:
    shards, busiest = shard_table(frame)
    return Group(job_line(frame, busiest, down), shards, worker_table(frame))


def frames(config: TopConfig) -> Iterator[Group]:
    """Yield a renderable every interval, forever."""
    targets = config.target_list()
    before, _ = scrape_all(targets, config.scrape_timeout_s)
    started = time.monotonic()
    while True:
        time.sleep(config.interval_s)
        after, down = scrape_all(targets, config.scrape_timeout_s)
        now = time.monotonic()
        if len(down) == len(targets):
            raise IMergeError(f"no metrics endpoint answers ({', '.join(targets.values())}); is the job running?")
        yield render(Frame(before, after, now - started), down)
        before, started = after, now


def run_top(config: TopConfig, console: Any) -> int:
    if config.once:
        console.print(next(frames(config)))
        return 0
    from rich.live import Live

    with Live(console=console, refresh_per_second=4) as live:
        for frame in frames(config):
            live.update(frame)
    return 0
