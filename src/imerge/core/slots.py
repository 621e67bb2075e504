"""Intra-iteration interleave: the slot policies, behind one interface. Pure: imports neither grpc nor redis.

A worker about to push a group holds the group's slot for the push::

    async with slots.hold(flag, nbytes) as slot:   # slot.fence goes with the push
        await push(...)

* :class:`NoSlots` (``--slots off``): nothing is taken; pushes go at once.
* :class:`AckSlots` (``ack``): take the group's flag (blocking, without
  polling, while another worker holds it); release it once the shard
  acknowledged the push.
* :class:`FixedSlots` (``fixed``, the write-up's): hold the flag for the
  group's slot time, ``bytes / ingress bandwidth``, even if the push ended
  earlier; the bandwidth is given, or measured online from the pushes.

The flags live in the control plane's store; a policy sees only its
:class:`FlagStore` methods (blocking calls, run off the event loop), so it is
unit-tested against a fake of them. Flags are opaque to the policy.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

log = logging.getLogger(__name__)
SLOTS = ("off", "fixed", "ack")
SLOT_SCOPES = ("group", "shard")


class Grant(Protocol):
    @property
    def contended(self) -> bool: ...

    @property
    def fence(self) -> int: ...


class FlagStore(Protocol):
    """The store's flag methods a slot policy uses."""

    def acquire_flag(self, flag: Any, token: str, lease_s: float, timeout_s: float, generation: int) -> Grant: ...

    def release_flag(self, flag: Any, token: str) -> bool: ...


@dataclasses.dataclass
class Slot:
    """One holding of a slot: when it was asked for, granted and released (wall clock), its fencing token."""

    requested: float
    acquired: float
    fence: int = 0
    contended: bool = False
    released: float = 0.0
    granted_at: float = dataclasses.field(default_factory=time.monotonic)  # for slot times

    @property
    def waited_s(self) -> float:
        return self.acquired - self.requested

    @property
    def held_s(self) -> float:
        return self.released - self.acquired


class NoSlots:
    """Slots off: every push goes at once, with no flag and no fencing token."""

    name = "off"
    holds_flags = False

    @contextlib.asynccontextmanager
    async def hold(self, flag: Any, nbytes: int) -> AsyncIterator[Slot]:
        now = time.time()
        slot = Slot(now, now)
        try:
            yield slot
        finally:
            slot.released = time.time()

    def observe(self, nbytes: int, seconds: float) -> None:
        """A push of ``nbytes`` took ``seconds`` (used by policies that measure the bandwidth)."""


class AckSlots(NoSlots):
    """Hold the group's flag from before the push until the shard acknowledged it."""

    name = "ack"
    holds_flags = True

    def __init__(self, store: FlagStore, *, owner: str, lease_s: float, timeout_s: float, generation: int):
        self.store = store
        self.owner = owner
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.generation = generation

    @contextlib.asynccontextmanager
    async def hold(self, flag: Any, nbytes: int) -> AsyncIterator[Slot]:
        token = f"{self.owner}:{uuid.uuid4().hex[:8]}"
        requested = time.time()
        grant = await asyncio.to_thread(self.store.acquire_flag, flag, token, self.lease_s, self.timeout_s,
                                        self.generation)
        slot = Slot(requested, time.time(), grant.fence, grant.contended)
        try:
            yield slot
            await self._after_push(slot, nbytes)
        finally:
            slot.released = time.time()
            if not await asyncio.to_thread(self.store.release_flag, flag, token):
                log.warning("%s: slot flag %s had passed to another holder (lease %.1fs)", self.owner, flag,
                            self.lease_s)

    async def _after_push(self, slot: Slot, nbytes: int) -> None:
        """What the holder does between the push's acknowledgement and the release: nothing."""


class SlotClock:
    """How long a fixed slot lasts: ``nbytes / bandwidth``, the bandwidth given or (0) measured online as a moving
    average of the pushes observed. The worker's :class:`FixedSlots` and the simulator's worker hold one each."""

    def __init__(self, bandwidth_bps: float = 0.0):
        self.measured = bandwidth_bps == 0
        self.bandwidth_bps = bandwidth_bps

    def observe(self, nbytes: int, seconds: float) -> None:
        if self.measured and seconds > 0:
            observed = nbytes / seconds
            self.bandwidth_bps = observed if self.bandwidth_bps == 0 else 0.8 * self.bandwidth_bps + 0.2 * observed

    def slot_time(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bps if self.bandwidth_bps > 0 else 0.0


class FixedSlots(AckSlots):
    """Hold the flag for the group's slot time (:class:`SlotClock`), even if the push ended earlier."""

    name = "fixed"

    def __init__(self, store: FlagStore, *, bandwidth_bps: float = 0.0, **options: Any):
        super().__init__(store, **options)
        self.clock = SlotClock(bandwidth_bps)

    def observe(self, nbytes: int, seconds: float) -> None:
        self.clock.observe(nbytes, seconds)

    async def _after_push(self, slot: Slot, nbytes: int) -> None:
        await asyncio.sleep(max(0.0, slot.granted_at + self.clock.slot_time(nbytes) - time.monotonic()))


def resolve_width(scope: str, width: int, num_shards: int) -> int:
    """The slot width: ``width``, or with 0 (auto) the shard count for scope ``shard`` (a worker's uplink is
    spread over the shards, so a port takes that many senders at full rate) and 1 for scope ``group``."""
    if width:
        return width
    return num_shards if scope == "shard" else 1


def effective_policy(name: str, width: int, num_workers: int) -> str:
    """``off`` where a slot of ``width`` lanes cannot be contended (every worker alone in its lane): taking its
    flags would only add round trips to the store."""
    return name if width < num_workers else "off"


def make_slots(name: str, store: FlagStore, *, owner: str, lease_s: float, timeout_s: float, generation: int,
               bandwidth_mbps: float = 0.0) -> NoSlots:
    """The slot policy ``name`` (one of SLOTS)."""
    if name == "off":
        return NoSlots()
    if name == "ack":
        return AckSlots(store, owner=owner, lease_s=lease_s, timeout_s=timeout_s, generation=generation)
    if name == "fixed":
        return FixedSlots(store, owner=owner, lease_s=lease_s, timeout_s=timeout_s, generation=generation,
                          bandwidth_bps=bandwidth_mbps * 1e6 / 8)
    raise ValueError(f"unknown slot policy {name!r}; choose from {', '.join(SLOTS)}")
