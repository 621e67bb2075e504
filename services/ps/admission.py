"""Which data connections the shard keeps: the admission policy of the data channel. Pure: no sockets, no grpc.

A connection is *pending* from its accept until its HELLO showed a valid token, then *admitted*. Pending
connections are strangers: they get a small table of their own (``max_pending``) and a total deadline for
the TLS handshake and the HELLO (``handshake_s``: a HELLO is a few dozen bytes, so the deadline is the minimum
rate too). A stranger that arrives when the pending table is full, or when the whole table
(``max_connections``, pending and admitted together) is full while a stranger holds a place, evicts the oldest
stranger: a flood of connections that never say HELLO keeps cycling through the pending places and never takes
an admitted worker's place, and a real worker's HELLO (which comes at once) gets through. Only a table full of
admitted connections refuses a newcomer, with a class the worker retries.

The caller owns the connections: :meth:`Admission.accept` and :meth:`Admission.expired` name the ones to end.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # what names a connection (the caller's own object for it)


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    max_connections: int   # pending and admitted together (--max-data-connections)
    max_pending: int       # not yet through their HELLO (--max-pending-data-connections)
    handshake_s: float     # from the accept to the HELLO's acceptance (--handshake-timeout-s)


class Admission(Generic[K]):
    """The table of a data channel's connections: ``accept`` a newcomer, ``admit`` it after its HELLO,
    ``release`` it when it ends."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self._pending: collections.OrderedDict[K, float] = collections.OrderedDict()  # key -> deadline
        self._admitted: set[K] = set()
        self.evicted = 0  # strangers ended to make room (a counter for the shard's metrics)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def admitted(self) -> int:
        return len(self._admitted)

    def accept(self, key: K, now: float) -> tuple[bool, list[K]]:
        """A new connection at ``now``: (whether it gets a place, the pending connections to end for it)."""
        evict: list[K] = []
        while self._pending and (len(self._pending) >= self.limits.max_pending
                                 or len(self._pending) + len(self._admitted) >= self.limits.max_connections):
            oldest, _ = self._pending.popitem(last=False)
            evict.append(oldest)
        self.evicted += len(evict)
        if len(self._admitted) >= self.limits.max_connections:
            return False, evict
        self._pending[key] = now + self.limits.handshake_s
        return True, evict

    def admit(self, key: K) -> bool:
        """The connection's HELLO was accepted: it keeps its place until it ends. False if it was evicted or
        timed out meanwhile (its end is on its way)."""
        if self._pending.pop(key, None) is None:
            return False
        self._admitted.add(key)
        return True

    def expired(self, now: float) -> list[K]:
        """The pending connections past their handshake deadline (dropped from the table: end them)."""
        late = []
        while self._pending:
            key, deadline = next(iter(self._pending.items()))
            if deadline > now:
                break
            del self._pending[key]
            late.append(key)
        return late

    def next_deadline(self) -> float | None:
        return next(iter(self._pending.values()), None)

    def release(self, key: K) -> None:
        self._pending.pop(key, None)
        self._admitted.discard(key)
