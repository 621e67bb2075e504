"""Slot-flag fencing tokens on a shard: which tokens a push may carry. Pure: the store's clock is a callable.

The store issues each slot flag's fencing token from Redis' clock (microseconds
at the grant), so no honest token is ahead of that clock when its push
arrives. :class:`IssuedTokens` keeps an estimate of Redis' clock (one read, then
the local monotonic clock) and reads it again before it calls a token too new:
a token still ahead of the fresh reading (plus a second of slack) was issued by
no flag, and adopting it would fence every honest push after it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

SLACK_US = 1_000_000


class IssuedTokens:
    def __init__(self, read_clock_us: Callable[[], int]):
        self._read_clock_us = read_clock_us  # blocking: run off the event loop
        self._reading: tuple[int, float] | None = None  # (Redis' clock, local monotonic clock) at the last read

    def _estimate_us(self) -> int | None:
        if self._reading is None:
            return None
        clock_us, at = self._reading
        return clock_us + int((time.monotonic() - at) * 1e6)

    def known(self, token: int) -> bool:
        """Whether ``token`` could have been issued by the clock as last read (False: read it, see unissued)."""
        estimate = self._estimate_us()
        return estimate is not None and token <= estimate + SLACK_US

    async def newest_us(self, token: int) -> int:
        """Redis' clock as far as needed to tell whether ``token`` could have been issued (read afresh when the
        estimate is behind it)."""
        estimate = self._estimate_us()
        if estimate is not None and token <= estimate + SLACK_US:
            return estimate
        at = time.monotonic()
        clock_us = await asyncio.to_thread(self._read_clock_us)
        self._reading = (clock_us, at)
        return clock_us

    async def unissued(self, token: int) -> int | None:
        """None if ``token`` could have been issued; else Redis' clock (µs) that it is ahead of, for the refusal."""
        clock_us = await self.newest_us(token)
        return None if token <= clock_us + SLACK_US else clock_us
