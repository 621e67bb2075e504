"""What --fusion cost measures during the first iterations: when each unit's gradient is
ready in backward, and what a push costs (alpha + beta * bytes, fitted to timed pushes)."""
from __future__ import annotations

import statistics
import threading


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

    def summary(self, unit_bytes: list[int]) -> dict:
        """Ready times averaged over the profiled iterations but the first (warm-up), non-decreasing."""
        measured = self.iterations[1:] or self.iterations
        ready, latest = [], 0.0
        for unit in range(self.num_units):
            latest = max(latest, statistics.fmean(it[unit] for it in measured) if measured else 0.0)
            ready.append(latest)
        alpha, beta = fit_cost(self.pushes)
        return {"ready_s": ready, "unit_bytes": unit_bytes, "alpha_s": alpha, "beta_s_per_byte": beta}
