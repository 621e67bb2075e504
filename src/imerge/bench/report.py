"""The benchmark's markdown table and PNG plots (matplotlib, headless)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imerge.core.bench_results import BenchReport, RunResult, ScalingReport
from imerge.sim.plots import pyplot

if TYPE_CHECKING:
    from imerge.bench.datapath import DatapathReport

COLUMNS = [("median_iteration_s", "median s/it", "{:.3f}"), ("p90_iteration_s", "p90 s/it", "{:.3f}"),
           ("compute_s", "compute s", "{:.3f}"), ("exposed_comm_s", "exposed comm s", "{:.3f}"),
           ("bytes_per_iteration", "MB/it/worker", "{:.2f}"), ("link_utilization", "link util", "{:.0%}"),
           ("ratio_to_bound", "x bound", "{:.2f}"), ("ratio_to_ddp", "x ddp", "{:.2f}"),
           ("push_p50_ms", "push p50 ms", "{:.1f}"), ("push_p99_ms", "push p99 ms", "{:.1f}"),
           ("tcp_retransmissions", "TCP retrans", "{:d}")]


def _cell(value: Any, fmt: str, key: str) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return fmt.format(value / 1e6 if key == "bytes_per_iteration" else value)


def markdown(report: BenchReport | ScalingReport) -> str:
    if isinstance(report, ScalingReport):
        return scaling_markdown(report)
    scenario = report.scenario
    lines = [f"{scenario.model}, batch {scenario.batch_size} per worker, {scenario.workers} workers, "
             f"{scenario.shards} shards, {scenario.rate_mbit:g} Mbit/s links"
             + f", MTU {scenario.mtu}, TCP {scenario.tcp_congestion}"
             + (f", shard port queue {scenario.shard_queue_kb:g} kB" if scenario.shard_queue_kb else "")
             + f"; compute {report.compute_s:.3f} s per iteration.", "",
             "| strategy | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for name, result in report.strategies.items():
        lines.append(f"| {name} | " + " | ".join(_cell(getattr(result, key), fmt, key) for key, _, fmt in COLUMNS)
                     + " |")
    lines += [decision_line(name, result) for name, result in report.strategies.items() if result.schedule]
    lines += [retransmission_line(name, result) for name, result in report.strategies.items()
              if result.tcp_retransmissions_per_host]
    return "\n".join(lines) + "\n"


def retransmission_line(name: str, result: RunResult) -> str:
    """Who retransmitted (the sender of a lost segment): shards for their pulls and acknowledgements, workers
    for their pushes; a DDP rank for its ring's sends."""
    hosts = sorted(result.tcp_retransmissions_per_host.items(), key=lambda item: (-item[1], item[0]))
    return f"\n{name}: TCP segments retransmitted by " + ", ".join(f"{host} {count}" for host, count in hosts) + "."


def decision_line(name: str, result: RunResult) -> str:
    """What --tune chose in a strategy's rounds, what it predicted and the runner-up's prediction, against what
    the rounds measured; the profile's compute beside the measured compute (a profile of the first iterations on
    busy cores is what a prediction's error most often comes from)."""
    predicted = f", predicted {result.predicted_s:.3f} s/it" if result.predicted_s else ""
    runner_up = (f"; runner-up {result.runner_up}, {result.runner_up_s:.3f} s/it"
                 if result.runner_up and result.runner_up_s else "")
    compute = (f"; compute profiled {result.profile_compute_s:.3f} s/it, measured "
               f"{result.compute_s:.3f}" if result.profile_compute_s and result.compute_s else "")
    return (f"\n{name}: --tune chose {result.schedule}{predicted}{runner_up} (measured mean "
            f"{statistics.fmean(result.iteration_s):.3f} s/it{compute}).")


def title(report: BenchReport | ScalingReport, what: str) -> str:
    """A plot's title: what it shows, and the scenario it was measured on."""
    scenario = report.scenario
    shards = "shards = workers" if scenario.sizes else f"{scenario.workers} workers, {scenario.shards} shards"
    name = f"{report.name}: " if report.name else ""
    return f"{what}\n{name}{scenario.model}, {shards}, {scenario.rate_mbit:g} Mbit/s"


def _plot_iteration_times(report: BenchReport, path: Path, plt: Any) -> None:
    names = list(report.strategies)
    medians = [report.strategies[n].median_iteration_s for n in names]
    p90 = [report.strategies[n].p90_iteration_s - m for n, m in zip(names, medians)]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(names, medians, yerr=[[0] * len(p90), p90], capsize=4, color="tab:blue")
    axis.axhline(report.compute_s, color="tab:red", linestyle="--", label="compute")
    axis.set_ylabel("seconds per iteration (median, whisker p90)")
    axis.set_title(title(report, "Iteration time per strategy"))
    axis.legend()
    plt.setp(axis.get_xticklabels(), rotation=30, ha="right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_timeline(report: BenchReport, path: Path, plt: Any) -> None:
    traced = [name for name, result in report.strategies.items()  # a strategy whose workers wrote traces
              if result.trace_dir and any(Path(result.trace_dir).glob("worker*.json"))]
    chosen = next((n for n in ("imerge", "slots-ack", "wfbp") if n in traced), traced[0] if traced else None)
    if chosen is None:
        return
    trace_dir = Path(report.strategies[chosen].trace_dir)
    workers = report.scenario.workers
    figure, axis = plt.subplots(figsize=(10, 1 + 0.8 * workers))
    colors = {"compute": "tab:green", "push": "tab:blue", "pull": "tab:orange", "forward-wait": "tab:red",
              "flag-wait": "tab:purple"}
    for rank, trace in enumerate(sorted(trace_dir.glob("worker*.json"))):
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        iterations = sorted((e for e in events if e["cat"] == "compute"), key=lambda e: e["ts"])
        if len(iterations) < 2:
            continue
        window = iterations[-2]
        start, end = window["ts"], iterations[-1]["ts"]
        for lane, categories in enumerate((("compute", "forward-wait"), ("push", "flag-wait"), ("pull",))):
            for e in sorted(events, key=lambda e: categories.index(e["cat"]) if e["cat"] in categories else 0):
                if e["cat"] in categories and e["ts"] < end and e["ts"] + e["dur"] > start:
                    begin = max(e["ts"], start)  # what began in the iteration before is drawn from 0
                    axis.broken_barh([((begin - start) / 1e3, (e["ts"] + e["dur"] - begin) / 1e3)],
                                     (rank * 4 + lane, 0.8), color=colors[e["cat"]])
    axis.set_xlim(left=0)
    axis.set_xlabel(f"ms into one iteration ({chosen})")
    axis.set_title(title(report, f"One iteration of {chosen}, per worker"))
    axis.set_yticks([r * 4 + 1 for r in range(workers)], [f"worker {r}" for r in range(workers)])
    axis.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
                loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_utilization(report: BenchReport, path: Path, plt: Any) -> None:
    rate_bps = report.scenario.rate_mbit * 1e6 / 8
    figure, axis = plt.subplots(figsize=(8, 4))
    for name in ("imerge", "wfbp", "slots-ack", "ddp"):
        result = report.strategies.get(name)
        if not result or len(result.utilization_series) < 2:
            continue
        series = result.utilization_series
        for host in series[0][1]:
            times = [(t - series[0][0]) for t, _ in series[1:]]
            rates = [(b[host] - a[host]) / (tb - ta) / rate_bps
                     for (ta, a), (tb, b) in zip(series, series[1:])]
            axis.plot(times, rates, label=f"{name} {host}")
        break
    axis.set_xlabel("seconds")
    axis.set_ylabel("link utilization")
    axis.set_ylim(0, 1.1)
    axis.set_xlim(left=0)
    axis.set_title(title(report, "Link utilization over time"))
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_report(report: BenchReport, out: Path) -> None:
    plt = pyplot("imerge bench")

    (out / "results.md").write_text(markdown(report))
    _plot_iteration_times(report, out / "iteration_time.png", plt)
    _plot_timeline(report, out / "timeline.png", plt)
    _plot_utilization(report, out / "link_utilization.png", plt)


def scaling_markdown(report: ScalingReport) -> str:
    """One row per strategy, one column per worker count: median s/it, samples/s, x bound, x ddp."""
    sizes = report.sizes
    scenario = report.scenario
    names = list(next(iter(sizes.values())).strategies)
    lines = [f"{scenario.model}, batch {scenario.batch_size} per worker, shards = workers, "
             f"{scenario.rate_mbit:g} Mbit/s links, MTU {scenario.mtu}, "
             f"TCP {scenario.tcp_congestion}. Each cell: median s/it, "
             "samples/s, x bound, x ddp.", "",
             "| strategy | " + " | ".join(f"W={w}" for w in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name in names:
        cells = []
        for workers, sized in sizes.items():
            result = sized.strategies[name]
            samples = workers * scenario.batch_size / result.median_iteration_s
            cells.append(f"{result.median_iteration_s:.2f} s, {samples:.1f}/s, "
                         f"{_cell(result.ratio_to_bound, '{:.2f}', '')}x, {_cell(result.ratio_to_ddp, '{:.2f}', '')}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_scaling_report(report: ScalingReport, out: Path) -> None:
    plt = pyplot("imerge bench B4")

    (out / "results.md").write_text(scaling_markdown(report))
    sizes = report.sizes
    workers = list(sizes)
    figure, axis = plt.subplots(figsize=(8, 4))
    for name in next(iter(sizes.values())).strategies:
        samples = [w * report.scenario.batch_size / sizes[w].strategies[name].median_iteration_s for w in workers]
        axis.plot(workers, samples, marker="o", label=name)
    axis.set_xlabel("workers (shards = workers)")
    axis.set_ylabel("samples per second")
    axis.set_xticks(workers)
    axis.set_title(title(report, "Throughput as the job scales"))
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the data, not on it
    figure.tight_layout()
    figure.savefig(out / "scaling.png", dpi=100)
    plt.close(figure)


DATAPATH_COLUMNS = [("median_iteration_s", "median s/it", "{:.3f}"), ("ratio_to_ddp", "x ddp", "{:.2f}"),
                    ("worker_gb_per_s", "worker GB/s", "{:.2f}"), ("worker_cpu_s_per_gb", "worker CPU s/GB", "{:.2f}"),
                    ("worker_comm_cpu_s_per_gb", "worker comm threads CPU s/GB", "{:.2f}"),
                    ("shard_gb_per_s", "shard GB/s", "{:.2f}"), ("shard_cpu_s_per_gb", "shard CPU s/GB", "{:.2f}")]


def datapath_markdown(report: DatapathReport) -> str:
    scenario = report.scenario
    lines = [f"{scenario.model} ({scenario.model_bytes / 1e6:.1f} MB), batch 1, {scenario.workers} workers, "
             f"{scenario.shards} shards (DDP: {scenario.workers} ranks), {scenario.network}, {scenario.iters} "
             f"iterations x {scenario.rounds} rounds. GB/s and CPU s/GB count payload bytes sent plus "
             "received by one process (DDP: a rank, in the worker columns); a worker's CPU includes its "
             "training thread (forward, backward, its hooks' gradient copies), its comm threads' CPU is all its "
             "threads but that one (DDP: gloo's threads). The raw socket's rows: the median of the probes made "
             "at the start of each round.", "",
             "| strategy | " + " | ".join(title for _, title, _ in DATAPATH_COLUMNS) + " |",
             "|---|" + "---|" * len(DATAPATH_COLUMNS)]
    for name, run in report.strategies.items():
        lines.append(f"| {name} | " + " | ".join(_cell(getattr(run, key), fmt, key) for key, _, fmt in DATAPATH_COLUMNS)
                     + " |")
    for limit in report.socket_limit:
        lines.append(f"| raw socket, {limit.frame_bytes >> 20} MiB frames | - | - | {limit.gb_per_s:.2f} | "
                     f"send {limit.send_cpu_s_per_gb:.2f} | send {limit.send_cpu_s_per_gb:.2f} | - | "
                     f"receive {limit.receive_cpu_s_per_gb:.2f} |")
    if report.command:
        lines += ["", f"Command: `{report.command}`"]
    return "\n".join(lines) + "\n"


def write_datapath_report(report: DatapathReport, out: Path) -> None:
    (out / "results.md").write_text(datapath_markdown(report))
