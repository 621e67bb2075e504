"""Simulating several strategies within a time budget, saying what takes long and what was left out.

A PS simulation costs about the same per *worker class* (``psjob.lane_positions``:
one without slot flags, one per position in a lane with them: ``W / width``),
so the cost of a strategy not yet run is estimated as the most seconds per
class any strategy took so far, times its classes. A strategy whose estimate
would take the run past its budget is not simulated; the report names it with
the estimate and the option that lifts the budget. Cheap strategies run
first (the report keeps the order asked for). Anything that takes over
:data:`TICK_S` says so every :data:`TICK_S` while it runs.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

R = TypeVar("R")
TICK_S = 5.0


@contextlib.contextmanager
def ticking(say: Callable[[str], None], what: str, every_s: float = TICK_S) -> Iterator[None]:
    """While the body runs past ``every_s``, a line every ``every_s`` saying it still runs, and for how long."""
    done, started = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            say(f"  still {what}: {time.monotonic() - started:.0f} s so far")

    ticker = threading.Thread(target=tick, name="sim-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def within_budget(names: list[str], classes: Callable[[str], int], run: Callable[[str], R], budget_s: float,
                  say: Callable[[str], None], extra_s: Callable[[str], float] = lambda name: 0.0
                  ) -> tuple[dict[str, R], dict[str, str]]:
    """``run`` each of ``names`` (in the order asked for in the result) unless its estimate, seconds per worker
    class so far times ``classes(name)`` plus ``extra_s(name)``, would take the whole past ``budget_s`` (0: no
    budget); return the results and, for each strategy left out, why."""
    started, per_class = time.monotonic(), 0.0
    results: dict[str, R] = {}
    skipped: dict[str, str] = {}
    counts = {name: classes(name) for name in names}
    order = sorted(names, key=counts.__getitem__)  # the cheap ones first: as many answers as the budget allows
    for position, name in enumerate(order, 1):
        count = max(counts[name], 1)
        estimate = per_class * count + extra_s(name)
        elapsed = time.monotonic() - started
        if budget_s and per_class and elapsed + estimate > budget_s:
            skipped[name] = (f"not simulated: {count} worker classes, about {estimate:.0f} s, would take the run past "
                             f"--budget-s {budget_s:g} ({elapsed:.0f} s spent); --budget-s 0 simulates it")
            say(f"{name}: {skipped[name]}")
            continue
        if elapsed > TICK_S:
            say(f"simulating {name} ({position}/{len(order)}, {count} worker classes"
                + (f", about {estimate:.0f} s)" if per_class else ")"))
        began = time.monotonic()
        with ticking(say, f"simulating {name}"):
            results[name] = run(name)
        seconds = time.monotonic() - began
        if counts[name] > 0:  # DDP's ring (0 classes) tells nothing of a PS simulation's cost
            per_class = max(per_class, (seconds - extra_s(name)) / count)
    return {name: results[name] for name in names if name in results}, skipped
