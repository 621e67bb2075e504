"""--fusion cost and --profile-out: what the first iterations measure, and the switch to the plan made from it.

The profiler records when each unit's module starts its forward and when its
gradient is ready in backward (on the compute clock: forward waits taken out),
and what a push costs (alpha + beta * bytes, fitted to timed pushes). After the
profiled iterations, worker 0 writes the profile (``--profile-out``: the input
of ``imerge simulate``) and, with fusion cost, submits it; every worker then
waits for the coordinator's cost plan, which regroups the unchanged blocks.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from imerge.control.store import WorkerStore
from imerge.control.messages import Profile
from imerge.core.errors import IMergeError
from imerge.core.planning import BYTES_PER_ELEMENT, COST_PLAN, Plan, fit_cost
from imerge.sim.profiles import from_measurement

log = logging.getLogger(__name__)


class Profiler:
    def __init__(self, num_units: int, plans: bool = True):
        self.num_units = num_units
        self.plans = plans  # fusion cost: the profiled iterations sync every group, whatever T
        self.iterations: list[list[float]] = []
        self.forwards: list[tuple[list[float], float]] = []  # per iteration: each unit's start, the forward's end
        self.starts: list[float] = []  # each profiled iteration's start (its forward's), monotonic seconds
        self.ended = 0.0  # when the last backward ended
        self._current: list[float] | None = None
        self._forward: list[float] | None = None
        self._started = 0.0
        self.pushes: list[tuple[int, float]] = []
        self._lock = threading.Lock()

    def forward_started(self) -> None:
        self._forward = [math.nan] * self.num_units
        self.starts.append(time.monotonic())

    def unit_forward(self, units: list[int], compute_clock_s: float) -> None:
        """These units' module starts its forward ``compute_clock_s`` into the forward (waits not counted)."""
        if self._forward is not None:
            for unit in units:
                if math.isnan(self._forward[unit]):
                    self._forward[unit] = compute_clock_s

    def forward_ended(self, compute_clock_s: float) -> None:
        if self._forward is not None:
            self.forwards.append((self._forward, compute_clock_s))
            self._forward = None

    def backward_started(self, now: float) -> None:
        self._started = now
        self._current = [0.0] * self.num_units

    def unit_progress(self, unit: int, now: float) -> None:
        if self._current is not None:
            self._current[unit] = max(self._current[unit], now - self._started)

    def backward_ended(self) -> None:
        self.ended = time.monotonic()
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
        return Profile(ready_s=ready, unit_bytes=unit_bytes, alpha_s=alpha, beta_s_per_byte=beta,
                       forward_s=self.forward_times(), iteration_s=self.iteration_time())

    def iteration_time(self) -> float:
        """The profiled iterations' mean wall time but the first's (warm-up), waits included: from each forward's
        start to the next (the last one's to the end of its backward); 0 with one iteration."""
        spans = [end - start for start, end in zip(self.starts, self.starts[1:] + [self.ended])][1:]
        return statistics.fmean(spans) if spans and all(span > 0 for span in spans) else 0.0


    def forward_times(self) -> list[float]:
        """Each unit's forward time, averaged over the profiled iterations but the first: from its module's start to
        the next module's (in the order they ran); a unit whose module was never seen runs in no time."""
        measured = self.forwards[1:] or self.forwards
        totals = [0.0] * self.num_units
        for starts, end in measured:
            seen = sorted((t, u) for u, t in enumerate(starts) if not math.isnan(t))
            for (start, unit), (following, _) in zip(seen, seen[1:] + [(end, -1)]):
                totals[unit] += max(0.0, following - start) + (start if unit == seen[0][1] else 0.0)
        return [t / len(measured) for t in totals] if measured else totals

    def compute_s(self) -> float:
        """The profiled compute per iteration (forward and backward, waits not counted): what --tune decides on."""
        return self.summary([0] * self.num_units).compute_s

    def backward_times(self) -> list[float]:
        return self.summary([0] * self.num_units).backward_s()

    def write(self, path: str, plan: Plan) -> None:
        """The profile as ``imerge simulate --profile`` reads it (:mod:`imerge.sim.profiles`)."""
        summary = self.summary([u.numel * BYTES_PER_ELEMENT for u in plan.units])
        profile = from_measurement(Path(path).stem, [(u.module, u.numel, u.group) for u in plan.units],
                                   self.forward_times(), self.backward_times(), summary.alpha_s,
                                   summary.beta_s_per_byte)
        profile.write(path)
        log.info("profile of %d units (compute %.3f s per iteration) written to %s", len(plan.units),
                 profile.compute_s, path)


def cost_plan(store: WorkerStore, profiler: Profiler, current: Plan, rank: int, wait_timeout_s: float,
              wire_bytes: Callable[[Any], int] | None = None, generation: int = 0) -> Plan:
    """After the profiled iterations: submit the profile (worker 0), wait for the cost plan and check that it
    only regroups the blocks of ``current``. ``wire_bytes(block)``: what a push of the block carries (after
    compression), so that the cost model prices the bytes the pushes were measured with. A failure meanwhile (the
    job leaves ``generation``) raises GenerationChanged at once: the plan will come in the next generation."""
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
    plan: Plan = store.wait_switch_plan(COST_PLAN, generation, wait_timeout_s,
                                        f"the coordinator's cost plan (v{COST_PLAN})").result()
    if plan.blocks != current.blocks:
        raise IMergeError("the cost plan changed the blocks; only the groups may change")
    return plan
