"""What a round of a block is besides its gradients: the options its pushes carry, and the scalars the shards
agree on before they step (global-norm clipping, "found inf" under loss scaling).

Every worker's push of a round carries the same :class:`RoundOptions`; a push
that disagrees is refused. A round that clips or unscales cannot step a block
until every block of the job has averaged its gradient: each block reports
its :class:`RoundScalars`, the shard sums its blocks' (:class:`Agreements`),
the shards exchange their sums, and every block steps with the same totals
(or every shard skips the step when any found an inf or NaN). Pure: no gRPC,
no Redis (the exchange is the server's).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable

from imerge.control.messages import RoundScalars
from imerge.core.errors import FailedPrecondition, InvalidArgument


@dataclasses.dataclass(frozen=True)
class RoundOptions:
    hypers: str = ""         # hyperparameters that differ from the initial ones (JSON, "" when none)
    assign: bool = False     # the data are parameters to assign (load_state_dict): no step
    loss_scale: float = 0.0  # the gradients are scaled by this (dynamic loss scaling): unscale, skip on inf
    max_norm: float = 0.0    # clip the averaged gradient to this global L2 norm (0: no clipping)
    clip_value: float = 0.0  # clamp the averaged gradient's elements to [-clip_value, clip_value] first (0: not)

    def check(self, what: str) -> "RoundOptions":
        for name in ("loss_scale", "max_norm", "clip_value"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{what}: {name} {value} is not a finite number >= 0")
        return self

    @property
    def needs_agreement(self) -> bool:
        return not self.assign and (self.loss_scale > 0 or self.max_norm > 0)

    def disagreement(self, other: "RoundOptions") -> str:
        """What differs between two pushes' options of one round ("" when nothing does)."""
        if self.assign != other.assign:
            return ("an assignment and a gradient in one round: load_state_dict() must run at the same point of "
                    "the loop on every worker")
        if self.hypers != other.hypers:
            return (f"hyperparameters {self.hypers or '(the initial ones)'} and {other.hypers or '(the initial ones)'}"
                    ": the workers' learning-rate (or other) schedules disagree")
        if (self.loss_scale, self.max_norm, self.clip_value) != (other.loss_scale, other.max_norm, other.clip_value):
            return (f"loss scale {self.loss_scale:g} / max norm {self.max_norm:g} / clip value {self.clip_value:g} "
                    f"and {other.loss_scale:g} / {other.max_norm:g} / {other.clip_value:g}: the workers' grad "
                    "scalers or clipping disagree")
        return ""


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
