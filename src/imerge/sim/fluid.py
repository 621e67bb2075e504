"""A fluid model of links and processors on a SimPy clock. Pure: no sockets, no grpc, no redis.

A :class:`Flow` moves a sequence of segments (bytes, or for a computation
seconds of work) across :class:`Link` resources. Rates follow max-min fairness
(progressive filling): every unfrozen flow's rate rises together until a link
is full or the flow reaches its own cap, so two equal flows on one link get
half of it each, and a flow held back elsewhere leaves the rest to the others.

Symmetry is what makes a thousand workers cheap: a flow may stand for
``count`` identical flows. It uses each link with a *weight*, the number of
those flows that cross one instance of the link: the pushes of a class of
``m`` identical workers to a class of ``n`` identical shards are one flow of
count ``m * n`` that loads each worker's uplink with weight ``n`` and each
shard's downlink with weight ``m``.

Incast: a link whose queue holds fewer packets than its concurrent senders
need delivers only ``incast_efficiency`` of its rate, the goodput left after
the losses and timeouts of a shallow switch queue.

A shared processor (the testbed: every role on the same few cores): a
computation needs its cores while it runs, a transfer ``cpu_per_byte`` core
seconds per byte (a PS's gRPC streams and DDP's gloo ring each their own);
when the demand exceeds the cores, every consumer slows in the same
proportion (processor sharing). Without one, a computation takes its
seconds and transfers cost no processor, except through a process's data
path (:func:`data_path`): a link of ``cores / cpu_per_byte`` bytes per second
that every flow the process sends or receives crosses, so that the process's
cores are shared by all its flows, not given to each.

Rates change only when a flow starts or ends; a segment's end within a flow
costs one heap operation.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np
import simpy

EPS = 1e-9  # what is left of a segment below this fraction of it is through
Process = Generator[simpy.Event, Any, Any]  # a SimPy process: the events it waits for, one after another


@dataclasses.dataclass(eq=False)
class Link:
    """One direction of a host's link (or a switch port): a rate in bytes per second."""

    name: str
    capacity: float
    incast_senders: float = math.inf  # more concurrent senders than this overflow its queue
    incast_efficiency: float = 1.0
    busy: float = 0.0                 # bytes it carried so far

    def effective(self, senders: float) -> float:
        return self.capacity * (self.incast_efficiency if senders > self.incast_senders else 1.0)


@dataclasses.dataclass(eq=False)
class Flow:
    segments: list[float]
    links: tuple[tuple[Link, float], ...]
    done: simpy.Event
    count: float = 1.0          # identical flows this one stands for (processor demand)
    cap: float = math.inf       # the most one of them may move per second
    cpu: float = 0.0            # cores per unit of rate (a computation: its cores; a transfer: per byte)
    on_segment: Callable[[int], None] | None = None
    index: int = 0              # the segment in progress
    left: float = 0.0           # what is left of it at ``stamp``
    stamp: float = 0.0
    rate: float = 0.0
    ticket: int = -1            # its entry in the heap of segment ends (stale when it differs)

    def advance(self, now: float) -> None:
        moved = self.rate * (now - self.stamp)
        if moved:
            self.left -= moved
            for link, weight in self.links:
                link.busy += moved * weight
        self.stamp = now


def data_path(name: str, cores: float, cpu_per_byte: float) -> tuple[Link, ...]:
    """One process's data path as a link of the bytes per second its cores can send or receive (none when its CPU
    is not counted: no cores given, or free bytes)."""
    return (Link(name, cores / cpu_per_byte),) if cores and cpu_per_byte else ()


class Fabric:
    """The flows in progress and their rates; wakes the SimPy clock at the next segment's end."""

    def __init__(self, env: simpy.Environment, cores: float = 0.0):
        self.env = env
        self.cores = cores  # 0: no shared processor
        self.flows: list[Flow] = []
        self._ends: list[tuple[float, int, Flow]] = []  # (time, ticket, flow)
        self._tickets = itertools.count()
        self._timer_at = math.inf

    # -- starting work ------------------------------------------------------------------------
    def transfer(self, sizes: Sequence[float], links: Sequence[tuple[Link, float]], *, count: float = 1.0,
                 cap: float = math.inf, cpu_per_byte: float = 0.0,
                 on_segment: Callable[[int], None] | None = None) -> simpy.Event:
        """Move ``sizes`` bytes one segment after another; ``on_segment(i)`` when segment i has arrived."""
        sizes = [max(float(s), 0.0) for s in sizes] or [0.0]
        flow = Flow(sizes, tuple(links), self.env.event(), count, cap, cpu_per_byte if self.cores else 0.0,
                    on_segment)
        self._add(flow)
        return flow.done

    def compute(self, seconds: float, *, count: float = 1.0, cores: float = 1.0) -> simpy.Event:
        """``seconds`` of work that takes ``cores`` cores while it runs (slower when the cores are shared)."""
        if not self.cores:
            return self.env.timeout(max(seconds, 0.0))
        flow = Flow([max(seconds, 0.0)], (), self.env.event(), count, 1.0, cores)
        self._add(flow)
        return flow.done

    def _add(self, flow: Flow) -> None:
        flow.left, flow.stamp = flow.segments[0], self.env.now
        self.flows.append(flow)
        self._rerate()

    def settle(self) -> None:
        """Bring every flow's progress (and the links' byte counts) to now."""
        for flow in self.flows:
            flow.advance(self.env.now)

    # -- the clock -----------------------------------------------------------------------------
    def _rerate(self) -> None:
        """Rates changed: bring every flow to now, share the links and cores anew, reschedule the segment ends."""
        now = self.env.now
        for flow in self.flows:
            flow.advance(now)
        ended = self._through(list(self.flows))
        self._rates()
        self._ends = []
        for flow in self.flows:
            self._schedule(flow)
        heapq.heapify(self._ends)
        if ended:  # a zero-length segment ended a flow at once
            self._rerate()
            return
        self._arm()

    def _schedule(self, flow: Flow, keep_heap: bool = False) -> None:
        """Put the end of the flow's current segment on the heap (``keep_heap``) or the list heapified next."""
        flow.ticket = next(self._tickets)
        if flow.rate > 0:
            entry = (flow.stamp + flow.left / flow.rate, flow.ticket, flow)
            heapq.heappush(self._ends, entry) if keep_heap else self._ends.append(entry)

    def _arm(self) -> None:
        if self._ends and self._ends[0][0] < self._timer_at:
            self._timer_at = at = self._ends[0][0]
            self.env.timeout(max(0.0, at - self.env.now)).callbacks.append(lambda _: self._wake(at))

    def _wake(self, at: float) -> None:
        if at != self._timer_at:
            return  # an earlier timer took over
        self._timer_at = math.inf
        now, due = self.env.now, []
        while self._ends and self._ends[0][0] <= now + 1e-12 * max(1.0, now):
            _, ticket, flow = heapq.heappop(self._ends)
            if ticket == flow.ticket and flow in self.flows:
                flow.advance(now)
                flow.left = 0.0
                due.append(flow)
        if self._through(due):
            self._rerate()
            return
        for flow in due:
            self._schedule(flow, keep_heap=True)
        self._arm()

    def _through(self, flows: list[Flow]) -> bool:
        """Complete the segments of ``flows`` that are through; True if a flow ended (the rates change)."""
        ended = False
        for flow in flows:
            while flow.left <= EPS * max(1.0, flow.segments[flow.index]):
                if flow.on_segment is not None:
                    flow.on_segment(flow.index)
                flow.index += 1
                if flow.index == len(flow.segments):
                    self.flows.remove(flow)
                    flow.done.succeed()
                    ended = True
                    break
                flow.left = flow.segments[flow.index]
        return ended

    # -- rates -------------------------------------------------------------------------------
    def _rates(self) -> None:
        """Max-min fair rates by progressive filling (numpy over the (flow, link) incidence)."""
        networked = [f for f in self.flows if f.links]
        for flow in self.flows:
            if not flow.links:
                flow.rate = flow.cap
        if networked:
            links: dict[Link, int] = {}
            rows, cols, weights = [], [], []
            for i, flow in enumerate(networked):
                for link, weight in flow.links:
                    rows.append(i)
                    cols.append(links.setdefault(link, len(links)))
                    weights.append(weight)
            for flow, rate in zip(networked, progressive_filling(
                    np.array(rows), np.array(cols), np.array(weights, dtype=float),
                    np.array([f.cap for f in networked]), list(links))):
                flow.rate = float(rate)
        self._share_cores()

    def _share_cores(self) -> None:
        if not self.cores:
            return
        demand = sum(f.count * f.cpu * f.rate for f in self.flows)
        if demand > self.cores:
            share = self.cores / demand
            for flow in self.flows:
                if flow.cpu:
                    flow.rate *= share


def progressive_filling(rows: np.ndarray, cols: np.ndarray, weights: np.ndarray, caps: np.ndarray,
                        links: list[Link]) -> np.ndarray:
    """Max-min fair rates of flows (``rows``) over links (``cols``) used with ``weights``; each flow at most
    its cap. Raises every unfrozen rate together until a link fills or a flow reaches its cap."""
    count = len(caps)
    capacity = np.array([link.capacity for link in links])
    senders = np.bincount(cols, weights=weights, minlength=len(links))
    room = np.array([link.effective(s) for link, s in zip(links, senders)])
    rate = np.zeros(count)
    active = np.ones(count, dtype=bool)
    while active.any():
        on = active[rows]
        demand = np.bincount(cols[on], weights=weights[on], minlength=len(links))
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.min(np.where(demand > 0, room / demand, np.inf))
        step = min(step, np.min((caps - rate)[active]))
        if not math.isfinite(step):
            break
        rate[active] += step
        room -= step * demand
        full = room <= 1e-9 * capacity
        blocked = np.bincount(rows, weights=full[cols].astype(float), minlength=count) > 0
        active &= ~blocked & (caps - rate > 1e-9 * np.maximum(rate, 1.0))
    return rate
