"""What a starting job waits for, in one line (``imerge launch`` shows it until the job trains). Pure.

A job starts in this order: its Redis (the launcher's own, or ``--redis-url``),
the shards (each registers its address once it serves), the workers (each
submits its layout when it joins), the coordinator's first plan (once every
layout is in), worker 0 creating the plan's blocks on the shards; then, where the job profiles (``--fusion cost``, ``--tune``), the
profiled iterations until the plan that is chosen from them.
"""
from __future__ import annotations

import dataclasses

TRAINING = "training"


@dataclasses.dataclass(frozen=True)
class Startup:
    """How far a job got, as its store says."""

    shards: int            # registered
    shards_expected: int
    workers: int           # joined (their layouts submitted)
    workers_expected: int
    plan_version: int      # the newest published plan (0: none yet)
    blocks_ready: bool     # worker 0 created the first plan's blocks on the shards


def waiting_for(state: Startup) -> str:
    """The line that says what the job waits for now."""
    if state.shards < state.shards_expected:
        return f"waiting for the shards to serve ({state.shards}/{state.shards_expected} registered)"
    if state.workers < state.workers_expected:
        return f"waiting for the workers to join ({state.workers}/{state.workers_expected})"
    if not state.plan_version:
        return "waiting for the coordinator's plan"
    if not state.blocks_ready:
        return "worker 0 creates the blocks on the shards"
    return TRAINING  # the blocks are in place: the workers train (a script need not report its iterations)


def stage_line(event: dict[str, object]) -> str:
    """The line of a worker's ``stage`` progress event (``profiling``, ``training``)."""
    stage = str(event.get("stage", ""))
    if stage == "profiling":
        return f"profiling until iteration {event.get('until', '?')}, then choosing the plan"
    return TRAINING if stage == TRAINING else stage
