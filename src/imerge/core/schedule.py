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
