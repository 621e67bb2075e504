"""Online re-tuning on the worker (``--tune`` with ``--retune-window R``), after the plan switch.

* Worker 0 measures each window of R iterations (the mean iteration time, the
  forwards' waits, the push cost fitted to the window's pushes) and reports it
  at the window's last iteration; the coordinator decides whether to re-tune.
* Every worker, at each window boundary, records that it looked and reads the
  newest plan version (one transaction); a re-tuned plan names ``switch_at``,
  a boundary no worker had reached when it was published, so every worker has
  read it by the boundary before and all switch after that iteration's
  backward, as they did at the first switch.
"""
from __future__ import annotations

import threading
import time

from imerge.control.messages import Window
from imerge.control.store import WorkerStore
from imerge.core.errors import IMergeError
from imerge.core.planning import Plan, fit_cost


class WindowMeter:
    """Worker 0's measurement of the current window (the pushes arrive on the comm thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pushes: list[tuple[int, float]] = []
        self._last: float | None = None  # when the previous iteration's backward ended
        self._timed = 0  # iterations timed in the window
        self._seconds = 0.0  # their time
        self._waited = 0.0

    def push(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._pushes.append((nbytes, seconds))

    def iteration(self, waited_s: float) -> None:
        """An iteration's backward ended; its forward waited ``waited_s``."""
        now = time.monotonic()
        if self._last is not None:
            self._timed += 1
            self._seconds += now - self._last
            self._waited += waited_s
        self._last = now

    def window(self, generation: int, plan: int, iteration: int) -> Window | None:
        """The window ending at ``iteration`` (None: no iteration timed yet); the meter starts the next."""
        with self._lock:
            pushes, self._pushes = self._pushes, []
        timed, seconds, waited = self._timed, self._seconds, self._waited
        self._timed, self._seconds, self._waited = 0, 0.0, 0.0
        if not timed:
            return None
        alpha, beta = fit_cost(pushes) if len(pushes) >= 4 else (0.0, 0.0)
        return Window(generation, plan, iteration, seconds / timed, waited / timed, alpha, beta)


class Retuning:
    """One worker's side of re-tuning: its polls at the window boundaries and the plans it is to switch to."""

    def __init__(self, store: WorkerStore, rank: int, window: int, known: int):
        self.store, self.rank, self.window = store, rank, window
        self.known = known  # the newest plan version this worker has read
        self.pending: list[Plan] = []  # published plans ahead, by switch iteration
        self.meter = WindowMeter() if rank == 0 else None

    def after_backward(self, iteration: int, generation: int, plan: int, waited_s: float) -> Plan | None:
        """Called after each backward (``plan``: the version in use): the plan to switch to now, if any."""
        if self.meter is not None:
            self.meter.iteration(waited_s)
        if iteration % self.window == 0:
            if self.meter is not None:
                measured = self.meter.window(generation, plan, iteration)
                if measured is not None:
                    self.store.submit_window(measured)
            self.read_plans(self.store.poll_plans(self.rank, iteration))
        if self.pending and self.pending[0].switch_at < iteration:
            raise IMergeError(f"worker {self.rank}: re-tuned plan v{self.pending[0].version} switches at iteration "
                              f"{self.pending[0].switch_at}, read only at {iteration}")
        if self.pending and self.pending[0].switch_at == iteration:
            return self.pending.pop(0)
        return None

    def read_plans(self, latest: int) -> None:
        """Read the plans published since the last look (every one names its switch iteration)."""
        for version in range(self.known + 1, latest + 1):
            published = self.store.read_plan(version)
            if published is None:
                raise IMergeError(f"worker {self.rank}: plan v{version} is announced but not in the store")
            self.pending.append(published.result())
        self.known = max(self.known, latest)
        self.pending.sort(key=lambda p: p.switch_at)
