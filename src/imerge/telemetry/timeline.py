"""Per-worker timeline of compute, push, pull, flag-wait and forward-wait intervals.

Written as Chrome trace JSON (one file per worker) that Perfetto and
chrome://tracing open. Times are wall-clock seconds, comparable across the
processes of one host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Interval:
    name: str
    category: str  # compute | push | pull | flag-wait | forward-wait
    start: float
    end: float
    args: dict[str, Any]


class Timeline:
    def __init__(self, rank: int):
        self.rank = rank
        self.intervals: list[Interval] = []
        self._lock = threading.Lock()

    def record(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            self.intervals.append(Interval(name, category, start, end, args))

    @contextlib.contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[dict[str, Any]]:
        start = time.time()
        try:
            yield args
        finally:
            self.record(name, category, start, time.time(), **args)

    def of(self, category: str) -> list[Interval]:
        with self._lock:
            return [i for i in self.intervals if i.category == category]

    def chrome_trace(self) -> dict[str, Any]:
        threads = {"compute": 1, "forward-wait": 1, "push": 2, "flag-wait": 2, "pull": 3}
        with self._lock:
            events = [{"name": i.name, "cat": i.category, "ph": "X", "ts": i.start * 1e6,
                       "dur": (i.end - i.start) * 1e6, "pid": self.rank, "tid": threads.get(i.category, 4),
                       "args": i.args} for i in self.intervals]
        names = {1: "compute", 2: "push", 3: "pull"}
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                   for tid, name in names.items()]
        events.append({"name": "process_name", "ph": "M", "pid": self.rank,
                       "args": {"name": f"worker {self.rank}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / f"worker{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path
