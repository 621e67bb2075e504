"""The coordinator role: waits for shards and layouts, publishes the plan, watches membership."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from imerge.config import CommonConfig, option, require
from imerge.errors import IMergeError, LayoutMismatchError
from imerge.planning import Layout, Plan, make_plan

from .store import Store

log = logging.getLogger(__name__)
PLAN_EVENT = "plan"


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig(CommonConfig):
    num_workers: int = option(1, "number of workers in the job")
    num_shards: int = option(1, "number of PS shards in the job")
    heartbeat_ttl_s: float = option(10.0, "a worker whose heartbeat is older than this is lost")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_workers >= 1, "num_workers", "must be at least 1")
        require(self.num_shards >= 1, "num_shards", "must be at least 1")
        require(self.heartbeat_ttl_s > 0, "heartbeat_ttl_s", "must be positive")


def check_layouts(layouts: dict[int, str]) -> Layout:
    """The agreed layout, or LayoutMismatchError naming the first difference."""
    reference = Layout.from_json(layouts[0])
    for rank in sorted(layouts)[1:]:
        reference.check_same(Layout.from_json(layouts[rank]), 0, rank)
    return reference


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: Store | None = None):
        self.config = config
        self.store = store or Store(config.redis_url, config.job)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def publish_plan(self) -> Plan:
        cfg = self.config
        addresses = self.store.wait_shards(cfg.num_shards, cfg.wait_timeout_s)
        log.info("all %d shards registered: %s", cfg.num_shards, ", ".join(addresses))
        layouts = self.store.wait_layouts(cfg.num_workers, cfg.wait_timeout_s)
        try:
            layout = check_layouts(layouts)
        except LayoutMismatchError as exc:
            self.store.set_event(PLAN_EVENT, json.dumps({"error": str(exc), "kind": "layout-mismatch"}))
            raise
        plan = make_plan(layout, cfg.num_workers, addresses, version=1)
        self.store.set_event(PLAN_EVENT, plan.to_json())
        log.info("published plan v%d: %d groups, %d blocks, elements per shard %s",
                 plan.version, len(plan.groups), len(plan.blocks), plan.shard_load())
        return plan

    def watch(self) -> None:
        """Until every worker is done: log workers whose heartbeat expired."""
        cfg = self.config
        done: set[int] = set()
        lost: set[int] = set()
        while len(done) < cfg.num_workers and not self._stop.is_set():
            rank = self.store.pop_done(min(cfg.heartbeat_ttl_s / 2, 1.0))
            if rank is not None:
                done.add(rank)
                log.info("worker %d finished (%d/%d)", rank, len(done), cfg.num_workers)
                continue
            live = set(self.store.live_workers(cfg.num_workers))
            for rank in sorted(set(range(cfg.num_workers)) - live - done - lost):
                log.error("worker %d lost: no heartbeat for %.1fs", rank, cfg.heartbeat_ttl_s)
                lost.add(rank)
            lost -= live

    def run(self) -> int:
        started = time.monotonic()
        try:
            self.publish_plan()
            self.watch()
        except IMergeError as exc:
            log.error("%s", exc)
            return 1
        log.info("job %s finished after %.1fs", self.config.job, time.monotonic() - started)
        return 0
