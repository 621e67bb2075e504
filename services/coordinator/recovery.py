"""The coordinator's recovery policy. Pure: imports neither grpc nor redis.

A failure reported in (or detected during) generation ``g`` starts generation
``g + 1`` from the newest checkpoint round that every shard holds complete.
Reports of an older generation describe a failure that was already handled;
a job that cannot recover (a fatal error that a recovery would only repeat,
recovery off, period T > 1, no common checkpoint, too many recoveries) fails
with the reason instead.
"""
from __future__ import annotations

import dataclasses

from imerge.control.messages import FailureReport, common_round
from imerge.core.errors import JobFailed


__all__ = ["RecoveryImpossible", "RecoveryPolicy", "common_round"]


class RecoveryImpossible(JobFailed):
    """The job cannot recover; the message says why."""


@dataclasses.dataclass
class RecoveryPolicy:
    num_shards: int
    enabled: bool = True
    max_recoveries: int = 10
    period: int = 1
    generation: int = 0

    def next_generation(self, failure: FailureReport, rounds_by_shard: dict[int, list[int]]) -> tuple[int, int] | None:
        """(new generation, checkpoint round) for ``failure``; None when it was already handled.

        RecoveryImpossible says why the job must fail instead.
        """
        if failure.generation < self.generation:
            return None
        if failure.fatal:
            raise RecoveryImpossible(f"{failure} (a fatal error: a recovery would only repeat it)")
        if not self.enabled:
            raise RecoveryImpossible(f"{failure} (recovery is off)")
        if self.period > 1:
            raise RecoveryImpossible(f"{failure}; recovery from a checkpoint needs --interleave-period 1 "
                                     f"(with T={self.period} the workers' local steps are in no checkpoint)")
        if self.generation >= self.max_recoveries:
            raise RecoveryImpossible(f"{failure}; the job already recovered {self.generation} times "
                                     f"(--max-recoveries {self.max_recoveries})")
        round_ = common_round(rounds_by_shard, self.num_shards)
        if round_ is None:
            raise RecoveryImpossible(f"{failure}; no checkpoint round is complete on every shard "
                                     f"({rounds_by_shard or 'none published'}; is --checkpoint-dir set?)")
        self.generation += 1
        return self.generation, round_
