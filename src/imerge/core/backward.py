"""What the training thread decides in each backward, group by group: events in, actions out. Pure, without I/O.

The worker's hooks (``services/worker/hooks.py``, autograd's gradient hooks and
its end-of-backward callback) and the simulator (:mod:`imerge.sim.psjob`, a
SimPy process per worker class) are two drivers of this one kernel: each tells
:class:`BackwardPolicy` what happened and carries out the actions it returns.

* :meth:`~BackwardPolicy.started`: a backward began (``accumulate``: under
  ``no_sync()``, its gradients are only summed locally).
* :meth:`~BackwardPolicy.gradient`: a gradient of a group is to be taken: its
  memory is what the group's previous push reads, so first :class:`WaitPushed`;
  then, where the group does not sync in this iteration (T > 1) and the backward
  is not accumulating, a :class:`LocalStep` of its parameters.
* :meth:`~BackwardPolicy.complete`: every gradient of the group is in: with
  overlap, a group that syncs in this iteration is queued at once
  (:class:`Enqueue`).
* :meth:`~BackwardPolicy.ended`: the backward ended: a group that got no
  gradient for every parameter is :class:`Unfinished` (the missing ones count as
  zeros) and completes now; without overlap (the naive PS) every syncing group is queued only now,
  and the iteration waits for all of them (:class:`WaitAll`).
* :meth:`~BackwardPolicy.profiling` / :meth:`~BackwardPolicy.restart` /
  :meth:`~BackwardPolicy.regrouped`: the schedule's changes (fusion cost's
  profiled iterations sync every group; a new plan's schedule counts from its
  first iteration, with its own groups).

With ``trace`` set, every event and its actions are recorded; :func:`replay`
feeds such a trace through a fresh kernel, so the worker's run and the
simulator's can be checked to decide alike.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

from .schedule import SyncSchedule


# The actions: what the driver carries out.
@dataclasses.dataclass(frozen=True)
class GroupAction:
    group: int


class WaitPushed(GroupAction):
    """Wait until the group's previous push is out (its gradient memory is about to be written)."""


class LocalStep(GroupAction):
    """The group does not sync in this iteration: its parameters take a local SGD step with the gradient."""


class Unfinished(GroupAction):
    """Not every gradient of the group came in this backward: the missing ones count as zeros."""


class Enqueue(GroupAction):
    """The group's sync goes on the comm queue."""


@dataclasses.dataclass(frozen=True)
class WaitAll:
    """The iteration waits for every queued sync (the naive PS: no overlap)."""


Action = Union[WaitPushed, LocalStep, Unfinished, Enqueue, WaitAll]


class BackwardPolicy:
    """One worker's backward passes: which groups are complete, which sync, what waits."""

    def __init__(self, groups: int, overlap: bool, schedule: SyncSchedule,
                 trace: list[dict[str, Any]] | None = None):
        self.groups, self.overlap, self.schedule = groups, overlap, schedule
        self.iteration = 0          # the backward's iteration (counted from the job's start)
        self.accumulating = False   # the backward runs under no_sync(): its gradients are only summed
        self.completed: set[int] = set()  # groups complete in this backward
        self.made: dict[str, Any] = {}  # as it was made, or as it was when its trace began (a replay's start)
        self.trace: list[dict[str, Any]] | None = None
        self.record(trace)

    def record(self, trace: list[dict[str, Any]] | None) -> None:
        """Record the events from now on into ``trace`` (None: stop), from the kernel as it is now."""
        self.made = {"groups": self.groups, "overlap": self.overlap, "period": self.schedule.period,
                     "start": self.schedule.start, "profiling": self.schedule.profiling}
        self.trace = trace
        if trace is not None:
            trace.append({"event": "start", **self.made})

    # -- events -------------------------------------------------------------------------------------
    def started(self, iteration: int, accumulate: bool = False) -> list[Action]:
        """A backward began, as iteration ``iteration`` (or a no_sync() micro-batch, ``accumulate``)."""
        self.iteration, self.accumulating = iteration, accumulate
        self.completed.clear()
        return self._record("started", [], iteration=iteration, accumulate=accumulate)

    def gradient(self, group: int) -> list[Action]:
        """A gradient of ``group`` is to be taken."""
        actions: list[Action] = [WaitPushed(group)]
        if not self.accumulating and not self.schedule.syncs(group, self.iteration):
            actions.append(LocalStep(group))
        return self._record("gradient", actions, group=group)

    def complete(self, group: int) -> list[Action]:
        """Every gradient of ``group`` is in (this backward's, or none: :meth:`ended`)."""
        return self._record("complete", self._complete(group), group=group)

    def ended(self) -> list[Action]:
        """The backward ended: the groups without a gradient complete; without overlap, every sync goes now."""
        actions: list[Action] = []
        if not self.accumulating:
            for group in range(self.groups):
                if group not in self.completed:
                    actions += [Unfinished(group), *self._complete(group)]
            if not self.overlap:
                syncing = [group for group in range(self.groups) if self.schedule.syncs(group, self.iteration)]
                actions += [*(Enqueue(group) for group in syncing), WaitAll()]
        self.completed.clear()
        return self._record("ended", actions)

    def profiling(self, on: bool) -> None:
        """Fusion cost's profiled iterations (``on``): every group syncs in each, whatever T."""
        self.schedule.profiling = on
        self._record("profiling", [], on=on)

    def restart(self, iteration: int, period: int) -> None:
        """A new plan's schedule counts from ``iteration`` with its own period."""
        self.schedule.restart(iteration, period)
        self._record("restart", [], iteration=iteration, period=period)

    def regrouped(self, groups: int) -> None:
        """A plan switch: the job has ``groups`` groups from now on."""
        self.groups = groups
        self._record("regrouped", [], groups=groups)

    # -- rules ---------------------------------------------------------------------------------------
    def _complete(self, group: int) -> list[Action]:
        self.completed.add(group)
        if self.overlap and not self.accumulating and self.schedule.syncs(group, self.iteration):
            return [Enqueue(group)]
        return []

    def _record(self, name: str, actions: list[Action], **args: Any) -> list[Action]:
        """With a trace, the event and its actions (nothing is built without one: the training thread's path)."""
        if self.trace is not None:
            self.trace.append({"event": name, **args,
                               "actions": [[type(a).__name__, *dataclasses.astuple(a)] for a in actions]})
        return actions


def replay(trace: Sequence[dict[str, Any]], like: BackwardPolicy) -> list[dict[str, Any]]:
    """Feed the events of ``trace`` (recorded by a :class:`BackwardPolicy` from its start) through a fresh kernel
    made as ``like`` was made (or was when its trace began), and return what it decided, in the trace's form. The result equals ``trace`` when
    both decide alike."""
    schedule = SyncSchedule(like.made["period"], like.made["start"])
    schedule.profiling = like.made["profiling"]
    fresh = BackwardPolicy(like.made["groups"], like.made["overlap"], schedule, trace=[])
    for event in trace[1:]:
        args = {key: value for key, value in event.items() if key not in ("event", "actions")}
        getattr(fresh, event["event"])(**args)
    return fresh.trace or []
