"""The inter-iteration interleave schedule (docs/scheduler.md). Pure.

Group ``g``'s counter ``iter(g)`` starts at ``g mod T`` and grows by one after
every backward; the group syncs when the counter is a multiple of T. Different
groups therefore sync in different iterations, each iteration carrying about
1/T of the bytes. With T = 1 every group syncs every iteration.
"""
from __future__ import annotations


def syncs(group: int, iteration: int, period: int) -> bool:
    """Whether ``group`` syncs in ``iteration`` (0-based, counted from the schedule's start)."""
    return (group % period + iteration) % period == 0


def phase(group: int, period: int) -> int:
    """The first iteration (0..T-1) in which ``group`` syncs."""
    return (-group) % period


class SyncSchedule:
    """Whether a group syncs in an iteration: the interleave schedule of the plan, counted from ``start``."""

    __slots__ = ("period", "start", "profiling")

    def __init__(self, period: int, start: int = 0):
        self.period = period     # the plan's interleave period T
        self.start = start       # the iteration the plan's schedule counts from (a cost plan's first)
        self.profiling = False   # fusion cost profiles the first iterations: every group syncs in each

    def syncs(self, group: int, iteration: int) -> bool:
        """Whether ``group`` syncs in ``iteration`` (counted from the job's start)."""
        return syncs(group, iteration - self.start, 1 if self.profiling else self.period)

    def synced_last(self, group: int, iteration: int) -> bool:
        """Whether ``group`` synced in the iteration before ``iteration`` (the plan's schedule, for flush)."""
        return syncs(group, iteration - 1 - self.start, self.period)

    def relative(self, iteration: int) -> int:
        """``iteration`` counted from the schedule's start (what the timeline labels)."""
        return iteration - self.start

    def restart(self, iteration: int, period: int) -> None:
        """A new plan's schedule counts from ``iteration``."""
        self.start, self.period, self.profiling = iteration, period, False
