"""``imerge bench datapath``: the cost of moving bytes, PS against DDP (gloo), on loopback.

A communication-only model (4 x Linear(2048, 2048), 67 MB, batch 1) trained by
W workers and W shards on this host, against DDP with W ranks, strategies
alternating over ``--rounds`` (by default DDP and both of IMerge's data paths,
the data channel and gRPC), beside the raw-socket limit of the machine
(:mod:`imerge.bench.socket_probe`). Reported per strategy: seconds per iteration,
and for a worker and a shard (DDP: a rank) the payload moved per second and the
CPU seconds per GB moved. Payload bytes per iteration are the model's (M),
not socket counters (loopback has none per process): a PS worker sends and
receives M; a shard sends and receives W x its share of M; a DDP rank sends
and receives 2 (W - 1) / W x M (ring all-reduce). CPU is each process's
utime + stime over the timed iterations, read from ``/proc``; a worker's
includes its compute (forward, backward, its hooks' gradient copies: the
training thread), a DDP rank's also its local optimizer step. The worker
columns also give the CPU of every thread but the training thread (the
process's main thread): what the data path alone costs a worker (a DDP rank:
gloo's threads).
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

from imerge.bench.socket_probe import ProbeResult
from imerge.core.bench_results import JsonReport
from imerge.core.errors import IMergeError
from imerge.ops.launch import LaunchConfig, Launcher
from imerge.ops.redis_server import free_port

MODEL = "linear4"
DEFAULT_ITERS = 30
CLOCK_TICKS = 100  # USER_HZ: /proc's unit of CPU time on Linux


def model_bytes() -> int:
    from imerge.bench.runner import model_size

    return model_size(MODEL)


def cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """utime + stime of a live process (all its threads), or of one of its threads, from /proc; None once it is
    gone."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_of(pid: int) -> tuple[float, float] | None:
    """A live process's CPU seconds: all its threads, and all but its main thread (where a worker and a DDP rank
    train); None once it is gone."""
    whole, main = cpu_seconds(pid), cpu_seconds(pid, pid)
    return None if whole is None or main is None else (whole, whole - main)


class CpuSampler:
    """Samples the CPU time of every child of a running launcher."""

    def __init__(self, launcher: Launcher, interval_s: float = 0.1):
        self.launcher, self.interval_s = launcher, interval_s
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            taken = {child.role: cpu_of(child.process.pid) for child in list(self.launcher.children)}
            self.samples.append((time.time(), {role: cpu for role, cpu in taken.items() if cpu is not None}))

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def used(self, role: str, start: float, end: float) -> tuple[float, float]:
        """CPU seconds ``role`` used between the samples nearest to ``start`` and ``end``: all its threads, and all
        but its main thread."""
        mine = [(t, cpu[role]) for t, cpu in self.samples if role in cpu]
        if len(mine) < 2:
            raise IMergeError(f"datapath: too few CPU samples of {role}; run more --iters")
        first = min(mine, key=lambda s: abs(s[0] - start))[1]
        last = min(mine, key=lambda s: abs(s[0] - end))[1]
        return last[0] - first[0], last[1] - first[1]


@dataclasses.dataclass(frozen=True)
class DatapathRun:
    """One run of the data path on loopback: s/it, and one process's throughput and CPU per GB moved."""

    strategy: str
    median_iteration_s: float
    iterations: int
    worker_gb_per_s: float
    worker_cpu_s_per_gb: float
    shard_gb_per_s: float | None = None     # DDP has no shard
    shard_cpu_s_per_gb: float | None = None
    ratio_to_ddp: float | None = None
    worker_comm_cpu_s_per_gb: float | None = None  # all of a worker's threads but the training thread


@dataclasses.dataclass(frozen=True)
class DatapathScenario:
    model: str
    model_bytes: int
    workers: int
    shards: int
    iters: int
    rounds: int
    network: str = "loopback"


@dataclasses.dataclass(frozen=True)
class DatapathReport(JsonReport):
    """``imerge bench datapath``: each strategy's rounds merged (medians), each round, the socket's limit (the
    median of its rounds' probes, and each round's)."""

    scenario: DatapathScenario
    strategies: dict[str, DatapathRun]
    runs: dict[str, list[DatapathRun]]
    socket_limit: list[ProbeResult]
    command: str = ""
    socket_limit_rounds: list[list[ProbeResult]] = dataclasses.field(default_factory=list)


def run_once(strategy: str, options: dict[str, Any], workers: int, iters: int, out: Path) -> DatapathRun:
    """One run of ``strategy`` on loopback; its s/it and per-role throughput and CPU cost."""
    from imerge.core.strategies import untimed_iterations, warmup_iterations

    ddp = strategy == "ddp"
    skip = 2 if ddp else warmup_iterations(iters)
    job = {"IMERGE_MODEL": MODEL, "IMERGE_DATA": "synthetic", "IMERGE_ITERS": str(iters),
           "IMERGE_BATCH_SIZE": "1", "IMERGE_EVALUATE": "0", "IMERGE_SAMPLES": str(max(64, 4 * workers)),
           "IMERGE_PROFILE_ITERS": str(skip), "IMERGE_DDP_MASTER": f"127.0.0.1:{free_port()}",
           "IMERGE_LR": "1e-5"}  # the stacked linear layers diverge (NaN, which a shard refuses) at larger rates
    schedule = {f"IMERGE_{k.upper()}": ("1" if v else "0") if isinstance(v, bool) else str(v)
                for k, v in options.items()}
    config = LaunchConfig(workers=workers, shards=workers, log_dir=str(out), log_level="WARNING")
    launcher = Launcher(config, job, [sys.executable, "-m", "imerge.bench.ddp_baseline"] if ddp else None,
                        console=Console(file=io.StringIO()), schedule_env=schedule, workers_only=ddp, quiet=True)
    with CpuSampler(launcher) as sampler:
        code = launcher.run()
    if code != 0:
        raise IMergeError(f"datapath: strategy {strategy} failed (exit code {code}); logs in {out}")
    steps = [e for e in launcher.events if e.get("event") == "iteration" and e.get("rank", 0) == 0]
    untimed = skip if ddp else untimed_iterations(iters)
    timed = [e for e in steps if e["iteration"] > untimed]
    if len(timed) < 3:
        raise IMergeError(f"datapath: only {len(timed)} timed iterations of {strategy} (the first {untimed} are not "
                          f"timed); run --iters {untimed + 3} or more")
    start, end = timed[0]["received"], timed[-1]["received"]
    iterations = timed[-1]["iteration"] - timed[0]["iteration"]
    seconds = statistics.median(e["seconds"] for e in timed)
    size = model_bytes()
    moved = {"worker": 4 * (workers - 1) / workers * size if ddp else 2 * size, "shard": 2 * size}
    roles = {"worker": "worker0"} if ddp else {"worker": "worker0", "shard": "ps0"}
    rates: dict[str, float] = {}
    for kind, role in roles.items():
        window_bytes = moved[kind] * iterations
        cpu, besides_main = sampler.used(role, start, end)
        rates[f"{kind}_gb_per_s"] = window_bytes / (end - start) / 1e9
        rates[f"{kind}_cpu_s_per_gb"] = cpu / (window_bytes / 1e9)
        if kind == "worker":
            rates["worker_comm_cpu_s_per_gb"] = besides_main / (window_bytes / 1e9)
    return DatapathRun(strategy, seconds, len(timed), **rates)


def run_datapath(config: Any, console: Console) -> DatapathReport:
    """Every chosen strategy (default: ddp and both of IMerge's data paths), alternating over ``config.rounds``."""
    from imerge.bench.report import write_datapath_report
    from imerge.bench.socket_probe import merged as merged_limits, probes
    from imerge.core.strategies import STRATEGIES

    workers = config.workers or 2
    iters = config.iters or DEFAULT_ITERS
    chosen = [s.strip() for s in config.strategies.split(",") if s.strip()] or ["ddp", "imerge", "imerge-grpc"]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise IMergeError(f"--strategies: {', '.join(unknown)} not in {', '.join(STRATEGIES)}")
    out = Path(config.out or f"runs/bench-datapath-{time.strftime('%Y%m%d-%H%M%S')}")
    runs: dict[str, list[DatapathRun]] = {s: [] for s in chosen}
    limits: list[list[ProbeResult]] = []
    for round_ in range(config.rounds):
        console.print(f"datapath round {round_ + 1}: the raw-socket limit of this machine (Python sendall and "
                      "recv_into + add_)")
        limits.append(probes())
        for strategy in chosen:
            console.print(f"datapath round {round_ + 1}: {strategy}")
            result = run_once(strategy, STRATEGIES[strategy], workers, iters, out / f"round{round_ + 1}" / strategy)
            console.print(f"    median {result.median_iteration_s:.3f} s/it")
            runs[strategy].append(result)
    merged = {name: _merged(results) for name, results in runs.items()}
    if "ddp" in merged:
        ddp_s = merged["ddp"].median_iteration_s
        merged = {name: dataclasses.replace(run, ratio_to_ddp=run.median_iteration_s / ddp_s)
                  for name, run in merged.items()}
    command = " ".join(["imerge", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else ""
    report = DatapathReport(DatapathScenario(MODEL, model_bytes(), workers, workers, iters, config.rounds),
                            merged, runs, merged_limits(limits), command, limits)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report.to_json(), indent=2))
    write_datapath_report(report, out)
    console.print(f"results in {out}/ (results.json, results.md)")
    return report


def _merged(runs: list[DatapathRun]) -> DatapathRun:
    """The rounds of one strategy: the median of each measure (the first round's count of iterations)."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    first = runs[0]
    return DatapathRun(first.strategy, statistics.median(r.median_iteration_s for r in runs), first.iterations,
                       statistics.median(r.worker_gb_per_s for r in runs),
                       statistics.median(r.worker_cpu_s_per_gb for r in runs),
                       median([r.shard_gb_per_s for r in runs]), median([r.shard_cpu_s_per_gb for r in runs]),
                       worker_comm_cpu_s_per_gb=median([r.worker_comm_cpu_s_per_gb for r in runs]))
