"""This worker's rank lease: one live process per rank of a job.

A worker claims its rank before it touches the job. The lease is a Redis key
that expires after the heartbeat TTL unless its holder renews it (every third
of the TTL, from the heartbeat thread), so:

* a rank whose holder died frees itself within one TTL; a holder on this host
  whose process is gone (the launcher restarting it) is replaced at once;
* a second process claiming a live rank waits for the holder's next renewal,
  which proves the holder alive, and raises :class:`RankInUse` naming it
  (within a third of the TTL), before it has written anything of the job;
* a holder that finds its lease taken by another (it paused longer than the
  TTL) marks itself ``lost``; the model refuses to train on.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from imerge.control.messages import RankHolder, RankLeaseValue
from imerge.control.store import WorkerStore
from imerge.core.errors import RankInUse

log = logging.getLogger(__name__)


def _holder_gone(holder: RankHolder) -> bool:
    """Whether ``holder`` is a process of this host that no longer exists (another host's, or this process's own
    pid, cannot be judged here)."""
    if holder.host != socket.gethostname() or holder.pid == os.getpid():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class RankLease:
    def __init__(self, store: WorkerStore, job: str, rank: int, ttl_s: float):
        self.store, self.job, self.rank, self.ttl_s = store, job, rank, ttl_s
        self.holder = RankHolder(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:8])
        self.beat = 0
        self.lost = False

    def claim(self) -> None:
        """Take the rank, waiting at most one TTL for a dead holder's lease to expire."""
        started = time.monotonic()
        deadline = started + self.ttl_s + 2.0
        replacing: RankLeaseValue | None = None
        while True:
            held = self.store.claim_rank(self.rank, self.holder, self.ttl_s, replacing)
            if held is None:
                return
            value, remaining_ms = held
            holder = value.holder
            if _holder_gone(holder):
                log.info("rank %d: its previous holder %s is gone; taking its lease", self.rank, holder)
                replacing = value
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankInUse(self._refusal(holder, f"its lease did not expire in {time.monotonic() - started:.1f}s"))
            if self.store.wait_rank_renewed(self.rank, min(remaining, max(remaining_ms, 10) / 1000 + 0.05)):
                raise RankInUse(self._refusal(holder, f"it renewed its lease {time.monotonic() - started:.1f}s "
                                                      "after this process asked"))

    def _refusal(self, holder: RankHolder, evidence: str) -> str:
        return (f"rank {self.rank} of job {self.job} is held by a live process ({holder}; {evidence}): a second "
                f"process cannot join as the same rank; check RANK / --rank (the job is untouched)")

    def renew(self) -> None:
        """Renew the lease (or take it again if it expired unclaimed); mark it lost if another holds it."""
        self.beat += 1
        if not self.lost and not self.store.renew_rank(self.rank, self.holder, self.beat, self.ttl_s):
            self.lost = True
            log.error("rank %d: another process took this rank's lease (this one did not renew it within %gs)",
                      self.rank, self.ttl_s)

    def check(self) -> None:
        if self.lost:
            raise RankInUse(f"this process lost rank {self.rank}'s lease to another process of job {self.job} "
                            f"(it did not renew it within --heartbeat-ttl-s {self.ttl_s:g}); it must not train on")

    def release(self) -> None:
        self.store.release_rank(self.rank, self.holder)
