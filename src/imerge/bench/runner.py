"""``imerge bench SCENARIO``: every strategy on the same workload, on the testbed, in one run.

Each strategy runs the same built-in job in a fresh testbed (one namespace per
role, tbf-shaped links); strategies alternate over ``--rounds``. Per strategy it
reports median and p90 iteration time, compute time, exposed communication
(time the forward waited), bytes per iteration, mean link utilization, the
ratio to the physical bound ``max(compute, bytes each worker moves / link
rate, bytes each shard moves / link rate)`` (links are full duplex: a host's
bytes are the larger of what it sends and receives), and the ratio to ``ddp``.
"""
from __future__ import annotations

import dataclasses
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from imerge.core.bench_results import BenchReport, RunResult, ScalingReport, StrategyResult
from imerge.core.config import option, require
from imerge.core.errors import IMergeError
from imerge.core.knobs import describe
from imerge.ops.launch import LaunchConfig, Launcher, TestbedHosts
from imerge.bench.testbed import HostCounters, Testbed, TestbedConfig, job_roles, start_redis
from imerge.core.strategies import (INCAST, SCENARIOS, STRATEGIES, TCP_CONGESTION, Scenario, untimed_iterations,
                                    warmup_iterations)



@dataclasses.dataclass(frozen=True)
class BenchConfig:
    rounds: int = option(1, "how many times each strategy runs (strategies alternate)")
    iters: int = option(0, "iterations per run (0: the scenario's default)")
    strategies: str = option("", "comma-separated subset of the scenario's strategies (default: all)")
    workers: int = option(0, "run at this worker count only (B4: shards = workers)")
    sizes: str = option("", "B4: comma-separated worker counts to scale over (default: 1,2,3,4,5,6)")
    rate_mbit: float = option(0.0, "override the scenario's link rate, Mbit/s")
    mtu: int = option(0, "override the scenario's link MTU (default 9000; 1500 for B3)")
    tcp_congestion: str = option(TCP_CONGESTION, "TCP congestion control of every testbed host (cubic: Linux's "
                                 "default)")
    out: str = option("", "output folder (default: runs/bench-<scenario>-<time>)")
    calibrate: bool = option(False, "after the run, fit the simulator's constants to it (imerge simulate): "
                                    "calibration.json and calibration.md beside results.json")

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "rounds", "must be at least 1")
        require(self.iters >= 0, "iters", "must be >= 0")
        require(self.workers >= 0, "workers", "must be >= 0")
        require(all(part.strip().isdigit() and 1 <= int(part) <= 16 for part in self.sizes.split(",") if self.sizes),
                "sizes", "must be comma-separated worker counts within 1..16, e.g. 1,2,4")
        require(self.rate_mbit >= 0, "rate_mbit", "must be >= 0")
        require(self.mtu == 0 or 576 <= self.mtu <= 65000, "mtu", "must be 0 or within 576..65000")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


class CounterSampler:
    """Samples every host's kernel counters while a run goes on (link utilization over time)."""

    def __init__(self, bed: Testbed, hosts: list[str], interval_s: float = 0.25):
        self.bed, self.hosts, self.interval_s = bed, hosts, interval_s
        self.samples: list[tuple[float, dict[str, HostCounters]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        self.samples.append((time.time(), {h: self.bed.counters(h) for h in self.hosts}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._take()
            except Exception:  # noqa: BLE001 - a namespace may vanish at the very end
                return

    def __enter__(self) -> "CounterSampler":
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, start: float, end: float
               ) -> tuple[float, dict[str, HostCounters], dict[str, HostCounters]] | None:
        """The samples nearest to [start, end]: (seconds, first counters, last counters); None if the
        window is shorter than one sampling interval."""
        first = min(self.samples, key=lambda s: abs(s[0] - start))
        last = min(self.samples, key=lambda s: abs(s[0] - end))
        if last[0] <= first[0]:
            return None
        return last[0] - first[0], first[1], last[1]


@dataclasses.dataclass(frozen=True)
class TraceMetrics:
    """From the workers' Chrome traces: each timed iteration's compute and exposed communication, each push."""

    compute_s: list[float]
    exposed_s: list[float]
    push_ms: list[float]


def trace_metrics(trace_dir: Path, workers: int, skip: int) -> TraceMetrics:
    """Compute, exposed communication and push latencies from the workers' Chrome traces."""
    compute: list[float] = []
    exposed: list[float] = []
    push_ms: list[float] = []
    for rank in range(workers):
        path = trace_dir / f"worker{rank}.json"
        if not path.exists():
            continue
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        iterations = [e for e in events if e["cat"] == "compute" and e["args"]["iteration"] >= skip]
        waits = [e for e in events if e["cat"] == "forward-wait"]
        for it in iterations:
            start, end = it["ts"], it["ts"] + it["dur"]
            waited = sum(w["dur"] for w in waits if start <= w["ts"] < end)
            exposed.append(waited / 1e6)
            compute.append((it["dur"] - waited) / 1e6)
        push_ms += [e["dur"] / 1e3 for e in events if e["cat"] == "push"]
    return TraceMetrics(compute, exposed, push_ms)


def run_strategy(name: str, scenario: Scenario, iters: int, out: Path, rounds_dir: str) -> RunResult:
    run_dir = out / rounds_dir / name
    ddp = name == "ddp"
    links = TestbedConfig(rate_mbit=scenario.rate_mbit, shard_queue_kb=scenario.shard_queue_kb).links(
        job_roles(scenario.shards, scenario.workers))
    options = {**STRATEGIES, **INCAST}[name]
    schedule = {f"IMERGE_{k.upper()}": ("1" if v else "0") if isinstance(v, bool) else str(v)
                for k, v in options.items()}
    schedule["IMERGE_TRACE_DIR"] = str(run_dir / "trace")
    job = {"IMERGE_MODEL": scenario.model, "IMERGE_DATA": "synthetic", "IMERGE_ITERS": str(iters),
           "IMERGE_BATCH_SIZE": str(scenario.batch_size), "IMERGE_EVALUATE": "0",
           "IMERGE_SAMPLES": str(max(512, scenario.batch_size * scenario.workers * 4)),
           "IMERGE_PROFILE_ITERS": str(warmup_iterations(iters)), "GLOO_SOCKET_IFNAME": "eth0",
           "IMERGE_DDP_MASTER": "worker0:29500"}
    config = LaunchConfig(workers=scenario.workers, shards=scenario.shards, log_dir=str(run_dir),
                          log_level="WARNING")
    with Testbed(links, log_sink=lambda line: None, mtu=scenario.mtu,
                 tcp_congestion=scenario.tcp_congestion) as bed:
        if not ddp:
            config = dataclasses.replace(config, redis_url=start_redis(bed))
        hosts = [f"worker{r}" for r in range(scenario.workers)] + [f"ps{s}" for s in range(scenario.shards)]
        launcher = Launcher(config, job, [sys.executable, "-m", "imerge.bench.ddp_baseline"] if ddp else None,
                            console=Console(file=io.StringIO()), schedule_env=schedule, hosts=TestbedHosts(bed),
                            workers_only=ddp, quiet=True)
        with CounterSampler(bed, hosts, 0.1) as sampler:
            code = launcher.run()
        (run_dir / "samples.json").write_text(json.dumps([(t, {h: [c.tx_bytes, c.rx_bytes] for h, c in d.items()}) for t, d in sampler.samples]))
    if code != 0:
        raise IMergeError(f"strategy {name} failed (exit code {code}); logs in {run_dir}")
    return measure(name, scenario, launcher.events, sampler, run_dir, iters)


def measure(name: str, scenario: Scenario, events: list[dict[str, Any]], sampler: CounterSampler,
            run_dir: Path, iters: int) -> RunResult:
    skip = untimed_iterations(iters) if name != "ddp" else 2
    steps = [e for e in events if e.get("event") == "iteration"]
    timed = [e for e in steps if e["iteration"] > skip] or steps
    window = sampler.window(timed[0]["received"], timed[-1]["received"])
    iterations = max(1, timed[-1]["iteration"] - timed[0]["iteration"])
    if window is None:  # a run too short to sample: whole-run counters over all iterations
        (start, first), (end, last) = sampler.samples[0], sampler.samples[-1]
        window, iterations = (end - start, first, last), max(1, steps[-1]["iteration"])
    seconds, first, last = window
    rate_bps = scenario.rate_mbit * 1e6 / 8

    def moved(host: str) -> tuple[int, int]:
        return last[host].tx_bytes - first[host].tx_bytes, last[host].rx_bytes - first[host].rx_bytes

    workers = [moved(f"worker{r}") for r in range(scenario.workers)]
    shards = [moved(f"ps{s}") for s in range(scenario.shards)] if name != "ddp" else []
    measured_hosts = [h for h in sampler.hosts if h.startswith("worker" if name == "ddp" else "ps")]
    utilization = {h: max(moved(h)) / (seconds * rate_bps) for h in measured_hosts}
    traces = trace_metrics(run_dir / "trace", scenario.workers, skip)
    retrans = {h: last[h].tcp_retrans_segs - first[h].tcp_retrans_segs for h in sampler.hosts}
    iteration_s = [e["seconds"] for e in timed]
    chosen = [e for e in events if e.get("event") == "schedule"]
    return RunResult(
        name, iteration_s, statistics.median(iteration_s), percentile(iteration_s, 0.9), len(iteration_s),
        compute_s=statistics.median(traces.compute_s) if traces.compute_s else None,
        exposed_comm_s=statistics.median(traces.exposed_s) if traces.exposed_s else None,
        bytes_per_iteration=statistics.fmean(max(w) for w in workers) / iterations,
        worker_bytes_per_iteration=max(max(w) for w in workers) / iterations,
        shard_bytes_per_iteration=max((max(s) for s in shards), default=0) / iterations,
        link_utilization=statistics.fmean(utilization.values()) if utilization else None,
        link_utilization_per_shard=utilization,
        push_p50_ms=percentile(traces.push_ms, 0.5), push_p99_ms=percentile(traces.push_ms, 0.99),
        tcp_retransmissions=sum(retrans.values()),
        tcp_retransmissions_per_host={host: count for host, count in retrans.items() if count},
        utilization_series=[(t, {h: max(counters[h].rx_bytes, counters[h].tx_bytes) for h in measured_hosts})
                            for t, counters in sampler.samples],
        trace_dir=str(run_dir / "trace"),
        **decision_fields(chosen[-1] if chosen else {}))


def decision_fields(event: dict[str, Any]) -> dict[str, Any]:
    """What a run's last schedule event (worker 0's, at a tuned plan switch) says of the decision; nothing for a
    run without one (a strategy whose knobs were all given)."""
    if not event:
        return {}
    return {"schedule": describe(event.get("knobs") or {}), "predicted_s": event.get("predicted_s"),
            "runner_up": describe(event["runner_up"]) if event.get("runner_up") else "",
            "runner_up_s": event.get("runner_up_s") or None,
            "profile_compute_s": event.get("profile_compute_s") or None}


def _rounds_mean(values: list[float | None]) -> float | None:
    given = [v for v in values if v]
    return statistics.fmean(given) if given else None


def model_size(model: str) -> int:
    """Bytes of the model's trainable parameters."""
    from imerge.workloads.models import build_model

    return sum(p.numel() for p in build_model(model).parameters() if p.requires_grad) * 4


def summarize(scenario: Scenario, runs: dict[str, list[RunResult]], name: str = "") -> BenchReport:
    """Merge rounds per strategy (the last round's measures, every round's iterations); add the bound and the
    ratios."""
    rate_bps = scenario.rate_mbit * 1e6 / 8
    iteration_s = {strategy: [t for r in results for t in r.iteration_s] for strategy, results in runs.items()}
    medians = {strategy: statistics.median(times) for strategy, times in iteration_s.items()}
    computes = [results[-1].compute_s for results in runs.values() if results[-1].compute_s]
    compute = statistics.median(computes) if computes else 0.0
    model_bytes = model_size(scenario.model)
    even_ps = max(model_bytes, scenario.workers * model_bytes / scenario.shards) / rate_bps
    ring = 2 * (scenario.workers - 1) / scenario.workers * model_bytes / rate_bps
    merged = {}
    for strategy, results in runs.items():  # the bound from the model's bytes spread evenly: an unbalanced
        bound = max(compute, ring if strategy == "ddp" else even_ps)  # placement is not forgiven
        merged[strategy] = StrategyResult(**{
            **dataclasses.asdict(results[-1]), "iteration_s": iteration_s[strategy],
            "schedule": "; ".join(r.schedule for r in results if r.schedule),
            "runner_up": "; ".join(r.runner_up for r in results if r.runner_up),
            **{key: _rounds_mean([getattr(r, key) for r in results])
               for key in ("predicted_s", "runner_up_s", "profile_compute_s")},
            "median_iteration_s": medians[strategy], "p90_iteration_s": percentile(iteration_s[strategy], 0.9),
            "rounds": len(results), "bound_s": bound, "ratio_to_bound": medians[strategy] / bound if bound else None,
            "ratio_to_ddp": medians[strategy] / medians["ddp"] if "ddp" in medians else None})
    return BenchReport(scenario, compute, merged, name=name)


def resolve(name: str, config: BenchConfig) -> tuple[Scenario, list[str]]:
    """The scenario with the command line's overrides, and the strategies to run."""
    if name not in SCENARIOS:
        raise IMergeError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}, datapath, compression")
    scenario = SCENARIOS[name]
    if config.workers:
        scenario = dataclasses.replace(scenario, workers=config.workers, sizes=(),
                                       shards=config.workers if scenario.sizes else scenario.shards)
    if config.sizes:
        if not scenario.sizes:
            raise IMergeError(f"--sizes: scenario {name} does not scale; only B4 does")
        scenario = dataclasses.replace(scenario, sizes=tuple(int(part) for part in config.sizes.split(",")))
    if config.rate_mbit:
        scenario = dataclasses.replace(scenario, rate_mbit=config.rate_mbit)
    if config.mtu:
        scenario = dataclasses.replace(scenario, mtu=config.mtu)
    if config.iters:
        scenario = dataclasses.replace(scenario, iters=config.iters)
    scenario = dataclasses.replace(scenario, tcp_congestion=config.tcp_congestion)
    chosen = [s.strip() for s in config.strategies.split(",") if s.strip()] or list(scenario.strategies)
    unknown = [s for s in chosen if s not in scenario.strategies]
    if unknown:
        raise IMergeError(f"--strategies: {', '.join(unknown)} not in {', '.join(scenario.strategies)}")
    return scenario, chosen


def run_bench(name: str, config: BenchConfig, console: Console) -> BenchReport | ScalingReport:
    scenario, chosen = resolve(name, config)
    out = Path(config.out or f"runs/bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    command = " ".join(["imerge", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else ""
    from imerge.bench.report import write_report, write_scaling_report

    report: BenchReport | ScalingReport
    if not scenario.sizes:
        report = dataclasses.replace(run_scenario(name, scenario, chosen, config.rounds, out, console),
                                     command=command, name=name)
        write_report(report, out)
    else:
        reports = {}
        for workers in scenario.sizes:
            sized = dataclasses.replace(scenario, workers=workers, shards=workers, sizes=())
            reports[workers] = dataclasses.replace(
                run_scenario(f"{name} W={workers}", sized, chosen, config.rounds, out / f"W{workers}", console),
                name=f"{name} W={workers}")
            write_report(reports[workers], out / f"W{workers}")
        report = ScalingReport(scenario, reports, command, name)
        write_scaling_report(report, out)
    (out / "results.json").write_text(json.dumps(report.to_json(), indent=2))
    console.print(f"results in {out}/ (results.json, results.md, *.png)")
    if config.calibrate:
        calibrate(out, console)
    return report


def calibrate(out: Path, console: Console) -> None:
    """Fit the simulator's constants to the run in ``out`` (its results.json)."""
    from imerge.sim.calibrate import cases_of, fit, fit_markdown, fit_table

    cases = [c for c in cases_of([str(out / "results.json")]) if c.strategy in STRATEGIES or c.strategy in INCAST]
    constants, loss = fit(cases, progress=lambda line: console.print(f"calibrate: {line}"))
    (out / "calibration.json").write_text(constants.to_json())
    (out / "calibration.md").write_text(fit_markdown(constants, loss, fit_table(cases, constants)))
    console.print(f"simulator constants in {out}/calibration.json (imerge simulate --calibration ...)")


def run_scenario(title: str, scenario: Scenario, chosen: list[str], rounds: int, out: Path,
                 console: Console) -> BenchReport:
    """Every chosen strategy on ``scenario``, alternating over ``rounds``; the merged report."""
    runs: dict[str, list[RunResult]] = {s: [] for s in chosen}
    total = rounds * len(chosen)
    for index, (round_, strategy) in enumerate((r, s) for r in range(rounds) for s in chosen):
        console.print(f"[{index + 1}/{total}] {title} round {round_ + 1}: {strategy}")
        result = run_strategy(strategy, scenario, scenario.iters, out, f"round{round_ + 1}")
        console.print(f"    median {result.median_iteration_s:.3f} s/it, "
                      f"{result.bytes_per_iteration / 1e6:.2f} MB/it per worker")
        runs[strategy].append(result)
    out.mkdir(parents=True, exist_ok=True)
    return summarize(scenario, runs)
