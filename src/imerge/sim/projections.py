"""``imerge simulate projections``: the scaling study of ``docs/scaling.md``, with its plots.

Four sweeps, each over the standard architectures (:data:`profiles.SYNTHETIC`):

* **bound**: every strategy at W = 8 .. 1,024 workers, S = W/4, W/2 and W
  shards, 10, 25 and 100 Gbit/s links: the iteration time and its ratio to the
  strategy's bound (DDP does not depend on S);
* **incast**: shard port queues of a few packets, with and without slots;
* **period**: T = 1, 2, 4 and 8: bytes per iteration against the local steps
  between syncs (staleness);
* **cores**: how many cores each data path needs (:mod:`.cores`).

The first three leave the data paths' CPU uncounted (as if every process had the
cores it needs); the fourth says how many that is.

Simulations run in a process pool (one per core); each is deterministic.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from imerge.core.schedule_config import ScheduleConfig

from .cluster import Cluster, Constants
from .cores import both_tasks, cores_markdown, cores_tasks
from .profiles import SYNTHETIC
from .results import ProjectionReport, ProjectionRow, Task
from .runner import SWEEPS, SimConfig, bounds, simulate_one

SIZES = (8, 32, 128, 512, 1024)
SHARDS_PER_WORKER = (0.25, 0.5, 1.0)
LINKS_GBIT = (10.0, 25.0, 100.0)
BOUND_STRATEGIES = ("ddp", "ps-naive", "wfbp", "size", "imerge", "imerge-T2", "imerge-T4", "auto")
FIXED_T1 = ("ps-naive", "wfbp", "size", "imerge")  # the fixed PS strategies at T = 1 that auto is held against
INCAST_STRATEGIES = ("imerge-noslots", "imerge", "imerge-fixed")
INCAST_QUEUE_KB = 64.0  # about 3.5 jumbo frames per port: two senders fit, more overflow
PERIODS = (1, 2, 4, 8)


def tasks(models: tuple[str, ...], sweeps: tuple[str, ...] = SWEEPS) -> list[Task]:
    jobs = cores_tasks(Task, models, LINKS_GBIT) if "cores" in sweeps else []
    for model in models:
        for workers in SIZES:
            for link in LINKS_GBIT:
                jobs.append(Task("bound", model, workers, workers, link, "ddp"))
                for fraction in SHARDS_PER_WORKER:
                    shards = max(1, int(workers * fraction))
                    jobs += [Task("bound", model, workers, shards, link, s) for s in BOUND_STRATEGIES if s != "ddp"]
            jobs += [Task("incast", model, workers, max(1, workers // 4), 25.0, s, INCAST_QUEUE_KB)
                     for s in INCAST_STRATEGIES]
            jobs += [Task("period", model, workers, max(1, workers // 2), 25.0, "imerge", period=t) for t in PERIODS]
    return [job for job in jobs if job.sweep in sweeps]


def run_task(task: Task, config: SimConfig, base: ScheduleConfig, constants: Constants) -> ProjectionRow:
    profile = dataclasses.replace(config, model=task.model, profile="").load_profile()
    cluster = Cluster(task.workers, task.shards, task.link_gbit, task.link_gbit, task.queue_kb, config.mtu,
                      task.shard_cores, task.worker_cores)
    if task.period > 1:  # the strategy's preset leaves the period as the base says
        base = dataclasses.replace(base, interleave_period=task.period)
    result = simulate_one(task.strategy, profile, cluster, constants, config.iters, base)
    ps_bound, ddp_bound = bounds(profile, cluster)
    bound = ddp_bound if task.strategy == "ddp" else ps_bound
    return ProjectionRow(**dataclasses.asdict(task), mean_iteration_s=result.mean_iteration_s,
                         bytes_per_iteration=result.bytes_per_iteration, bound_s=bound,
                         ratio_to_bound=result.mean_iteration_s / bound, compute_s=profile.compute_s,
                         model_bytes=profile.nbytes, simulated_in_s=result.simulated_in_s)


def run_projections(config: SimConfig, base: ScheduleConfig, out: Path, say: Callable[[str], None]
                    ) -> ProjectionReport:
    constants = config.constants()
    models = tuple(SYNTHETIC)
    todo = tasks(models, config.sweeps_chosen())
    say(f"{len(todo)} simulations, {config.iters} iterations each, on {os.cpu_count()} processes")
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        rows = _run_all(pool, todo, config, base, constants, say)
        if "cores" in config.sweeps_chosen():  # then each case at the cores recommended for both roles
            rows += _run_all(pool, both_tasks(Task, rows), config, base, constants, say)
    report = ProjectionReport(config.iters, config.batch_size, config.device_tflops, constants, rows)
    from .plots import plot_projections

    return dataclasses.replace(report, plots=plot_projections(report, out))


def _run_all(pool: concurrent.futures.Executor, todo: list[Task], config: SimConfig, base: ScheduleConfig,
             constants: Constants, say: Callable[[str], None]) -> list[ProjectionRow]:
    futures = [pool.submit(run_task, task, config, base, constants) for task in todo]
    rows = []
    for index, future in enumerate(futures):
        rows.append(future.result())
        if (index + 1) % 100 == 0:
            say(f"  {index + 1} / {len(todo)}")
    return rows


def _row(rows: list[ProjectionRow], **match: Any) -> ProjectionRow | None:
    for row in rows:
        if all(getattr(row, k) == v for k, v in match.items()):
            return row
    return None


def projections_markdown(report: ProjectionReport) -> str:
    rows = report.rows
    swept = {row.sweep for row in rows}
    lines = [f"Standard architectures, batch {report.batch_size} per worker at {report.device_tflops:g} "
             f"TFLOP/s; {report.iters} iterations simulated each.", ""]
    for model in SYNTHETIC if "bound" in swept else ():
        first = _row(rows, model=model)
        if first is None:
            continue
        lines += [f"### {model} ({first.model_bytes / 1e6:.0f} MB, compute {first.compute_s * 1e3:.1f} ms)", "",
                  "x bound (mean s/it over the strategy's bound); S = W/2; each cell: 10 / 25 / 100 Gbit/s.", "",
                  "| strategy | " + " | ".join(f"W={w}" for w in SIZES) + " |", "|---|" + "---|" * len(SIZES)]
        for strategy in BOUND_STRATEGIES:
            cells = []
            for workers in SIZES:
                shards = workers if strategy == "ddp" else max(1, workers // 2)
                values = [_row(rows, sweep="bound", model=model, workers=workers, shards=shards, link_gbit=link,
                               strategy=strategy) for link in LINKS_GBIT]
                cells.append(" / ".join(f"{v.ratio_to_bound:.2f}" for v in values if v))
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines += [_auto_line(rows, model), ""]
    if "bound" in swept:
        lines += _auto_summary(rows)
    if "incast" in swept:
        lines += _incast_lines(rows)
    if "period" in swept:
        lines += _period_lines(rows)
    return "\n".join(lines + cores_markdown(rows, SYNTHETIC)) + "\n"


def _auto_ratio(rows: list[ProjectionRow], **cell: Any) -> float | None:
    """auto's mean s/it over the best fixed T = 1 PS strategy's in one cell of the bound sweep."""
    auto = _row(rows, sweep="bound", strategy="auto", **cell)
    fixed = [r for s in FIXED_T1 if (r := _row(rows, sweep="bound", strategy=s, **cell)) is not None]
    return auto.mean_iteration_s / min(r.mean_iteration_s for r in fixed) if auto and fixed else None


def _auto_line(rows: list[ProjectionRow], model: str) -> str:
    cells = []
    for workers in SIZES:
        ratios = [_auto_ratio(rows, model=model, workers=workers, shards=max(1, workers // 2), link_gbit=link)
                  for link in LINKS_GBIT]
        cells.append(" / ".join(f"{r:.2f}" for r in ratios if r is not None))
    return "| auto / best fixed T = 1 | " + " | ".join(cells) + " |"


def _auto_summary(rows: list[ProjectionRow]) -> list[str]:
    cells = {(r.model, r.workers, r.shards, r.link_gbit) for r in rows if r.sweep == "bound" and r.strategy == "auto"}
    ratios = sorted(((ratio, cell) for cell in cells if (ratio := _auto_ratio(
        rows, model=cell[0], workers=cell[1], shards=cell[2], link_gbit=cell[3])) is not None), reverse=True)
    if not ratios:
        return []
    (worst, (model, workers, shards, link)) = ratios[0]
    within = sum(1 for ratio, _ in ratios if ratio <= 1.05)
    return [f"auto (what `--tune` chooses on the cell) over the best of {', '.join(FIXED_T1)} in each of the "
            f"{len(ratios)} cells of the bound sweep (S = W/4, W/2, W): within 1.05x in {within}, at most "
            f"{worst:.2f}x ({model}, W = {workers}, S = {shards}, {link:g} Gbit/s); median "
            f"{ratios[len(ratios) // 2][0]:.2f}x.", ""]


def _incast_lines(rows: list[ProjectionRow]) -> list[str]:
    lines = ["### Incast: shard port queue %g kB, S = W/4, 25 Gbit/s (mean s/it)" % INCAST_QUEUE_KB, "",
             "| model | strategy | " + " | ".join(f"W={w}" for w in SIZES) + " |", "|---|---|" + "---|" * len(SIZES)]
    for model in SYNTHETIC:
        for strategy in INCAST_STRATEGIES:
            cells = [_row(rows, sweep="incast", model=model, workers=w, strategy=strategy) for w in SIZES]
            lines.append(f"| {model} | {strategy} | " + " | ".join(f"{c.mean_iteration_s:.3f}" if c else "-"
                                                                   for c in cells) + " |")
    return lines + [""]


def _period_lines(rows: list[ProjectionRow]) -> list[str]:
    lines = ["### Interleave period T: S = W/2, 25 Gbit/s (mean s/it; MB per worker and iteration)", "",
             "| model | T | " + " | ".join(f"W={w}" for w in SIZES) + " |", "|---|---|" + "---|" * len(SIZES)]
    for model in SYNTHETIC:
        for period in PERIODS:
            cells = [_row(rows, sweep="period", model=model, workers=w, period=period) for w in SIZES]
            lines.append(f"| {model} | {period} | " + " | ".join(
                f"{c.mean_iteration_s:.3f} ({c.bytes_per_iteration / 1e6:.0f} MB)" if c else "-" for c in cells) + " |")
    return lines + [""]
