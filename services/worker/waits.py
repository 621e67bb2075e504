"""The training thread's waits on the comm thread: each bounded, each saying what it waited for.

A forward waits for the blocks that hold its module's parameters (not whole
groups); a backward waits for a group's previous push before it overwrites the
group's slice of the accumulator; ``synchronize`` waits for every group.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from imerge.core.errors import WaitTimeout
from imerge.telemetry.timeline import Timeline

from .comm import Communicator
from .groups import GroupRuntime, GroupTable, RoundResult
from .staging import DONE


class Waits:
    """The training thread's waits; ``in_flight`` holds the groups whose latest sync it has not waited for."""

    def __init__(self, rank: int, timeout_s: float, comm: Communicator, timeline: Timeline, in_flight: set[int]):
        self.rank, self.timeout_s = rank, timeout_s
        self.comm, self.timeline = comm, timeline
        self.in_flight = in_flight  # shared with the parameter guard, which waits through wait_params
        self.waited_s = 0.0  # this iteration's forward waits

    def wait(self, wait: Callable[[float], Any], group: GroupRuntime, what: str) -> Any:
        started = time.monotonic()
        try:
            result = wait(self.timeout_s)
        except concurrent.futures.TimeoutError:
            result = False
        if result is False:
            raise WaitTimeout(f"worker {self.rank}: timed out after {time.monotonic() - started:.1f}s "
                              f"waiting for {group} {what}")
        return result

    def pushed(self, group: GroupRuntime, what: str) -> None:
        """Wait until the group's latest push is out (its slice of the accumulator may be overwritten)."""
        if group.latest is not None and not group.latest.pushed.is_set():
            self.wait(group.latest.pushed.wait, group, what)

    def futures(self, group: GroupRuntime, futures: list[concurrent.futures.Future[int]], what: str,
                block_ids: list[str] | None = None) -> None:
        """Wait for these futures of the group; the forward's stream then waits for the copies back of the
        blocks it needs (``block_ids``; all of the group's when None)."""
        if not all(f.done() for f in futures):
            started = time.time()
            with self.timeline.span(f"wait {group.index}", "forward-wait", group=group.index):
                for future in futures:
                    self.wait(future.result, group, what)
            self.waited_s += time.time() - started
        for future in futures:
            future.result()  # re-raise a failed sync
        block_ids = block_ids if block_ids is not None else [block.block_id for block in group.blocks]
        for block_id in block_ids:
            self.comm.staging.before_use(self.comm.arrived.get(block_id, DONE))
        group.unsettled.difference_update(block_ids)
        if not group.unsettled:
            self.in_flight.discard(group.index)

    def params(self, table: GroupTable, param_ids: list[int]) -> None:
        """Wait until the blocks holding these parameters are back from their latest sync."""
        if not self.in_flight:
            return
        needed: dict[int, tuple[GroupRuntime, set[str]]] = {}
        for pid in param_ids:
            group = table.group_of.get(pid)
            if group is None or group.index not in self.in_flight:
                continue
            pending = group.unsettled.intersection(table.blocks_of[pid])
            if pending:
                needed.setdefault(group.index, (group, set()))[1].update(pending)
        for index in sorted(needed):
            group, block_ids = needed[index]
            latest, waited = group.latest, sorted(block_ids)
            if latest is not None:  # a group with unsettled blocks has a sync
                self.futures(group, [latest.block_futures[b] for b in waited],
                             f"round {group.round} of blocks {waited} to be pulled", waited)

    def all(self, table: GroupTable) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        for group in table.groups:
            if group.latest is not None:
                self.futures(group, [group.latest.future], f"round {group.round} to be pulled")

    def last_round(self, table: GroupTable) -> RoundResult | None:
        """What the shards said of the latest round pushed (waiting for its first block to come back)."""
        group = table.last_synced()  # the first layers: the group the next forward needs first
        if group is None or group.latest is None:
            return None
        block_id = group.blocks[0].block_id
        round_ = self.wait(group.latest.block_futures[block_id].result, group,
                           f"round {group.round} of block {block_id} to be pulled")
        return self.comm.round_results.get(round_)
