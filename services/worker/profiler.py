"""--fusion cost: what the first iterations measure, and the switch to the plan made from it.

The profiler records when each unit's gradient is ready in backward and what a
push costs (alpha + beta * bytes, fitted to timed pushes). After the profiled
iterations, worker 0 submits the profile; every worker then waits for the
coordinator's cost plan, which regroups the unchanged blocks.
"""
from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable
from typing import Any

from imerge.control.messages import COST_PLAN, Profile
from imerge.core.errors import IMergeError
from imerge.core.planning import BYTES_PER_ELEMENT, Plan

log = logging.getLogger(__name__)


def fit_cost(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (s/byte) of ``seconds = alpha + beta * bytes``, both >= 0."""
    if not samples:
        return 0.0, 0.0
    sizes = [float(b) for b, _ in samples]
    times = [t for _, t in samples]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(times)
    spread = sum((b - mean_size) ** 2 for b in sizes)
    if spread == 0:
        return min(times), 0.0
    beta = max(0.0, sum((b - mean_size) * (t - mean_time) for b, t in zip(sizes, times)) / spread)
    alpha = max(0.0, mean_time - beta * mean_size)
    return alpha, beta


class Profiler:
    def __init__(self, num_units: int):
        self.num_units = num_units
        self.iterations: list[list[float]] = []
        self._current: list[float] | None = None
        self._started = 0.0
        self.pushes: list[tuple[int, float]] = []
        self._lock = threading.Lock()

    def backward_started(self, now: float) -> None:
        self._started = now
        self._current = [0.0] * self.num_units

    def unit_progress(self, unit: int, now: float) -> None:
        if self._current is not None:
            self._current[unit] = max(self._current[unit], now - self._started)

    def backward_ended(self) -> None:
        if self._current is not None:
            self.iterations.append(self._current)
            self._current = None

    def push(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.pushes.append((nbytes, seconds))

    def summary(self, unit_bytes: list[int]) -> Profile:
        """Ready times averaged over the profiled iterations but the first (warm-up), non-decreasing."""
        measured = self.iterations[1:] or self.iterations
        ready, latest = [], 0.0
        for unit in range(self.num_units):
            latest = max(latest, statistics.fmean(it[unit] for it in measured) if measured else 0.0)
            ready.append(latest)
        alpha, beta = fit_cost(self.pushes)
        return Profile(ready_s=ready, unit_bytes=unit_bytes, alpha_s=alpha, beta_s_per_byte=beta)


def cost_plan(store: Any, profiler: Profiler, current: Plan, rank: int, wait_timeout_s: float,
              wire_bytes: Callable[[Any], int] | None = None) -> Plan:
    """After the profiled iterations: submit the profile (worker 0), wait for the cost plan and check that it
    only regroups the blocks of ``current``. ``wire_bytes(block)``: what a push of the block carries (after
    compression), so that the cost model prices the bytes the pushes were measured with."""
    if rank == 0:
        unit_bytes = [u.numel * BYTES_PER_ELEMENT for u in current.units]
        if wire_bytes is not None:
            unit_bytes = [0] * len(current.units)
            for block in current.blocks:
                unit_bytes[block.unit] += wire_bytes(block)
        profile = profiler.summary(unit_bytes)
        log.info("profile: alpha %.2e s, beta %.2e s/B, backward %.3f s", profile.alpha_s,
                 profile.beta_s_per_byte, profile.ready_s[-1])
        store.submit_profile(profile)
    plan = store.wait_plan(COST_PLAN, wait_timeout_s, f"the coordinator's cost plan (v{COST_PLAN})").result()
    if plan.blocks != current.blocks:
        raise IMergeError("the cost plan changed the blocks; only the groups may change")
    return plan
