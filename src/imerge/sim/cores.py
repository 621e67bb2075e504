"""The ``cores`` sweep of ``imerge simulate projections``: how many cores each data path needs. Pure.

On a cluster of real hosts every process spends its data path's measured CPU
seconds per byte (:class:`Constants`) on the cores it has. For each standard
architecture, W = 32 and 128 workers, S = W/2 shard hosts and 10, 25 and 100
Gbit/s links, each data path (``imerge``: the data channel, ``imerge-grpc``:
gRPC's streams, ``ddp``: gloo's ring) is simulated with its CPU not counted,
with one core each, with 1..64 cores for the shard hosts (the workers' CPU not
counted) and 1..32 for the workers (the shards' not counted). The recommended
count is the fewest cores within :data:`ENOUGH` of the time with the CPU not
counted; a last pass runs both roles at their recommended counts.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from .results import ProjectionRow

SIZES = (32, 128)
Task = TypeVar("Task")
Case = tuple[str, int, float, str]  # (model, W, link Gbit/s, strategy)
SHARD_CORES = (1, 2, 4, 8, 16, 32, 64)
WORKER_CORES = (1, 2, 4, 8, 16, 32)
STRATEGIES = ("imerge", "imerge-grpc")  # the data channel, gRPC's data path
ENOUGH = 1.05  # within 5% of the time with the data path's CPU not counted
FREE = 0.0     # a role's cores 0: its CPU is not counted


def cores_tasks(task_type: Callable[..., Task], models: Iterable[str], links: Iterable[float]) -> list[Task]:
    """The first pass: every (model, W, link, strategy) free, at one core each, and each role's cores alone."""
    jobs: list[Task] = []
    for model in models:
        for workers in SIZES:
            for link in links:
                shards = workers // 2

                def task(strategy: str, shard_cores: float, worker_cores: float) -> Task:
                    return task_type("cores", model, workers, shards, link, strategy, shard_cores=shard_cores,
                                     worker_cores=worker_cores)

                jobs += [task("ddp", FREE, FREE), task("ddp", FREE, 1.0)]
                jobs += [task("ddp", FREE, float(c)) for c in WORKER_CORES[1:]]
                for strategy in STRATEGIES:
                    jobs += [task(strategy, FREE, FREE), task(strategy, 1.0, 1.0)]
                    jobs += [task(strategy, float(c), FREE) for c in SHARD_CORES]
                    jobs += [task(strategy, FREE, float(c)) for c in WORKER_CORES]
    return jobs


def _case(row: ProjectionRow) -> Case:
    return row.model, row.workers, row.link_gbit, row.strategy


def recommend(rows: list[ProjectionRow]) -> dict[Case, tuple[float, float]]:
    """(model, W, link, strategy) -> the fewest (shard, worker) cores within ENOUGH of the free time; a role that
    no count tried gets there has the largest tried (its entry in the table says so)."""
    free = {_case(r): r.mean_iteration_s for r in rows
            if r.sweep == "cores" and r.shard_cores == FREE and r.worker_cores == FREE}
    chosen: dict[Case, tuple[float, float]] = {}
    for case, free_s in free.items():
        mine = [r for r in rows if r.sweep == "cores" and _case(r) == case]

        def fewest(role: str, other: str, counts: tuple[int, ...]) -> float:
            tried = sorted((getattr(r, role), r.mean_iteration_s) for r in mine
                           if getattr(r, other) == FREE and getattr(r, role) != FREE)
            if not tried:
                return FREE  # not tried: DDP has no shards
            return next((c for c, s in tried if s <= ENOUGH * free_s), float(counts[-1]))

        chosen[case] = (fewest("shard_cores", "worker_cores", SHARD_CORES),
                        fewest("worker_cores", "shard_cores", WORKER_CORES))
    return chosen


def both_tasks(task_type: Callable[..., Task], rows: list[ProjectionRow]) -> list[Task]:
    """The last pass: each case with both roles at their recommended cores."""
    return [task_type("cores-both", model, workers, workers // 2, link, strategy, shard_cores=shard,
                      worker_cores=worker)
            for (model, workers, link, strategy), (shard, worker) in recommend(rows).items()]


def cores_markdown(rows: list[ProjectionRow], models: Iterable[str]) -> list[str]:
    chosen = recommend(rows)
    if not chosen:
        return []

    def ratio(case: Case, sweep: str, shard: float, worker: float) -> str:
        row = next((r for r in rows if r.sweep == sweep and _case(r) == case and r.shard_cores == shard
                    and r.worker_cores == worker), None)
        return f"{row.ratio_to_bound:.2f}" if row else "-"

    lines = ["### Cores a data path needs (S = W/2; x bound: mean s/it over the strategy's bound)", "",
             f"Cores: the fewest within {ENOUGH:g}x of the time with the data path's CPU not counted "
             f"(shard host: of {', '.join(map(str, SHARD_CORES))}; worker: of "
             f"{', '.join(map(str, WORKER_CORES))}; a count marked + did not get there).", "",
             "| model | W | Gbit/s | strategy | shard host cores | worker cores | x bound, CPU free | "
             "x bound, 1 core each | x bound, at these cores |", "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for case, (shard, worker) in sorted(chosen.items(), key=lambda item: item[0][1:]):
            if case[0] != model:
                continue
            free_row = ratio(case, "cores", FREE, FREE)
            shard_cell = "-" if case[3] == "ddp" else _count(shard, SHARD_CORES, rows, case, "shard_cores")
            lines.append(f"| {model} | {case[1]} | {case[2]:g} | {case[3]} | {shard_cell} | "
                         f"{_count(worker, WORKER_CORES, rows, case, 'worker_cores')} | {free_row} | "
                         f"{ratio(case, 'cores', FREE if case[3] == 'ddp' else 1.0, 1.0)} | "
                         f"{ratio(case, 'cores-both', shard, worker)} |")
    return lines + [""]


def _count(cores: float, counts: tuple[int, ...], rows: list[ProjectionRow], case: Case, role: str) -> str:
    """The count, marked + when even the largest tried stayed beyond ENOUGH."""
    free_s = next(r.mean_iteration_s for r in rows if r.sweep == "cores" and _case(r) == case
                  and r.shard_cores == FREE and r.worker_cores == FREE)
    other = "worker_cores" if role == "shard_cores" else "shard_cores"
    row = next((r for r in rows if r.sweep == "cores" and _case(r) == case and getattr(r, role) == cores
                and getattr(r, other) == FREE), None)
    reached = row is not None and row.mean_iteration_s <= ENOUGH * free_s
    return f"{cores:g}" if reached or cores != counts[-1] else f"{cores:g}+"

