"""What a round of a block is besides its gradients: the options its pushes carry, and the scalars the shards
agree on before they step (global-norm clipping, "found inf" under loss scaling).

Every worker's push of a round carries the same :class:`~imerge.core.rounds.RoundOptions`
(a push that disagrees is refused). A round that clips or unscales cannot step a block
until every block of the job has averaged its gradient: each block reports
its :class:`RoundScalars`, the shard sums its blocks' (:class:`Agreements`),
the shards exchange their sums, and every block steps with the same totals
(or every shard skips the step when any found an inf or NaN). Pure: no gRPC,
no Redis (the exchange is the server's).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from imerge.control.messages import RoundScalars
from imerge.core.errors import FailedPrecondition



Exchange = Callable[[int, RoundScalars], Awaitable[RoundScalars]]


class Agreements:
    """One shard's rounds that await every block's scalars, then the other shards' (``exchange``)."""

    def __init__(self, exchange: Exchange | None = None):
        self.exchange = exchange
        self._rounds: dict[int, tuple[RoundScalars, set[str], asyncio.Future[RoundScalars]]] = {}

    def reset(self) -> None:
        """Forget the rounds in progress (a restore replaced the blocks; their waits fail with the old ones)."""
        for _, _, done in self._rounds.values():
            if not done.done():
                done.cancel()
        self._rounds.clear()

    async def agree(self, round_: int, block_id: str, scalars: RoundScalars, expected: set[str]) -> RoundScalars:
        """The job's totals of ``round_``, once every block in ``expected`` reported its scalars here."""
        total, reported, done = self._rounds.get(round_) or (RoundScalars(), set(), asyncio.get_running_loop()
                                                              .create_future())
        if block_id in reported:
            raise FailedPrecondition(f"block {block_id} reported round {round_}'s scalars twice")
        total, reported = total.plus(scalars), reported | {block_id}
        self._rounds[round_] = (total, reported, done)
        if reported >= expected:
            del self._rounds[round_]
            try:
                done.set_result(await self.exchange(round_, total) if self.exchange else total)
            except Exception as exc:  # noqa: BLE001 - every block of the round learns it
                done.set_exception(exc)
        return await asyncio.shield(done)
