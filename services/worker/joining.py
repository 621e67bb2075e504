"""Joining a running job: where a restarted worker resumes, and the heartbeat that keeps its rank."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from imerge.control.messages import FailureReport, Member, WorkerPosition
from imerge.control.store import WorkerStore
from imerge.core.errors import IMergeError, JobFailed, StoreError
from imerge.core.planning import FIRST_PLAN, Plan

from .config import WorkerConfig
from .lease import RankLease

log = logging.getLogger(__name__)


def rejoin_point(store: WorkerStore, config: WorkerConfig, num_shards: int) -> tuple[int, int]:
    """(generation, checkpoint round) a restarted worker resumes at, once every shard restored it."""
    current = store.generation()
    if current is None:
        raise StoreError("Redis holds no generation for a running job: it lost the job's state")
    mine = store.worker_generation(config.rank)
    if mine is not None and mine >= current:  # this worker died and no recovery followed yet: ask for one
        store.report_failure(FailureReport(current, str(Member.worker(config.rank)), "restarted after its process died"))
        store.wait_generation(current + 1, config.wait_timeout_s, f"the coordinator to start generation {current + 1}")
        current = store.generation() or current + 1
    while True:
        event = store.generation_event(current)
        if event is None or event.round is None:
            raise JobFailed(f"the job cannot recover: "
                            f"{event.error if event else f'generation {current} has no event'}")
        failed = [r.error for r in (store.wait_restored(current, shard, config.wait_timeout_s)
                                    for shard in range(num_shards)) if r.error]
        if not failed:
            return current, event.round
        # a shard could not read that round: it reported it, and the coordinator starts the next generation
        # from an older round every shard holds (or publishes why the job cannot recover)
        log.warning("generation %d cannot start: %s; waiting for the next", current, failed[0])
        store.wait_generation(current + 1, config.wait_timeout_s, f"the coordinator to start generation "
                                                                  f"{current + 1} after {failed[0]}")
        current += 1


def wait_plan(store: WorkerStore, config: WorkerConfig) -> Plan:
    return store.wait_plan(FIRST_PLAN, config.wait_timeout_s, "the coordinator to publish the plan").result()


def latest_plan(store: WorkerStore, config: WorkerConfig) -> Plan:
    """The plan a rejoining worker uses: the cost plan once published, else the first."""
    latest = store.latest_plan()
    return latest.result() if latest is not None else wait_plan(store, config)


class Heartbeat:
    """Renews this worker's rank lease, refreshes its liveness key and its data position until stopped."""

    def __init__(self, store: WorkerStore, lease: RankLease):
        self.position: Callable[[], tuple[int, int]] | None = None  # (generation, iterations done) once joined
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, lease), daemon=True,
                                        name=f"imerge-heartbeat-{lease.rank}")
        self._thread.start()

    def _run(self, store: WorkerStore, lease: RankLease) -> None:
        rank, ttl_s = lease.rank, lease.ttl_s
        while not self._stop.wait(ttl_s / 3):
            try:
                lease.renew()
                position = self.position() if self.position is not None else None
                store.heartbeat(rank, ttl_s, position[0] if position else -1)
                if position is not None:
                    store.record_worker(rank, WorkerPosition(iteration=position[1], generation=position[0]))
            except IMergeError as exc:
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
