"""The coordinator role: waits for shards and layouts, publishes the plan, watches membership."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from imerge.config import CommonConfig, option, require
from imerge.errors import IMergeError, LayoutMismatchError, PlanError
from imerge.metrics import MetricsServer
from imerge.planning import Layout, Plan, PlanOptions, fuse_cost, make_plan

from .metrics import coordinator_registry
from .store import Store

log = logging.getLogger(__name__)


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


def check_layouts(payloads: dict[int, str]) -> tuple[Layout, PlanOptions]:
    """The agreed layout and scheduling options, or LayoutMismatchError naming the first difference."""
    decoded = {rank: json.loads(text) for rank, text in payloads.items()}
    reference = Layout.from_json(json.dumps(decoded[0]["layout"]))
    options = decoded[0]["options"]
    for rank in sorted(decoded)[1:]:
        reference.check_same(Layout.from_json(json.dumps(decoded[rank]["layout"])), 0, rank)
        for name, value in options.items():
            if decoded[rank]["options"].get(name) != value:
                raise LayoutMismatchError(f"worker {rank} disagrees with worker 0 on option {name}: "
                                          f"{decoded[rank]['options'].get(name)!r} vs {value!r}")
    return reference, PlanOptions(**options)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: Store | None = None):
        self.config = config
        self.store = store or Store(config.redis_url, config.job)
        self._stop = threading.Event()
        self.plan: Plan | None = None  # the latest published plan

    def stop(self) -> None:
        self._stop.set()

    def publish_plan(self) -> Plan:
        cfg = self.config
        addresses = self.store.wait_shards(cfg.num_shards, cfg.wait_timeout_s)
        log.info("all %d shards registered: %s", cfg.num_shards, ", ".join(addresses))
        layouts = self.store.wait_layouts(cfg.num_workers, cfg.wait_timeout_s)
        try:
            layout, options = check_layouts(layouts)
            plan = make_plan(layout, cfg.num_workers, addresses, version=1, options=options)
        except (LayoutMismatchError, PlanError) as exc:
            kind = "layout-mismatch" if isinstance(exc, LayoutMismatchError) else "plan"
            self.store.set_event("plan:1", json.dumps({"error": str(exc), "kind": kind}))
            raise
        self._publish(plan)
        if options.fusion == "cost":
            plan = self.publish_cost_plan(layout, options, plan)
        return plan

    def _publish(self, plan: Plan) -> None:
        self.store.set_event(f"plan:{plan.version}", plan.to_json())
        self.plan = plan
        log.info("published plan v%d: %d groups, %d blocks, bytes per shard and phase %s",
                 plan.version, len(plan.groups), len(plan.blocks), plan.shard_load())

    def publish_cost_plan(self, layout: Layout, options: PlanOptions, first: Plan) -> Plan:
        """Regroup the blocks of ``first`` from worker 0's profile (fusion cost)."""
        profile = json.loads(self.store.wait_profile(self.config.wait_timeout_s))
        groups = fuse_cost(profile["ready_s"], profile["unit_bytes"], profile["alpha_s"],
                           profile["beta_s_per_byte"])
        plan = make_plan(layout, first.num_workers, first.shard_addresses, first.version + 1, options,
                         groups=groups, placement_of=[b.shard for b in first.blocks])
        log.info("cost plan from alpha %.2e s, beta %.2e s/B: %d units in %d groups", profile["alpha_s"],
                 profile["beta_s_per_byte"], len(profile["unit_bytes"]), len(groups))
        self._publish(plan)
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

    def serve_metrics(self) -> MetricsServer:
        registry = coordinator_registry(self.store, self.config.num_workers, self.config.link_mbps,
                                        lambda: self.plan.version if self.plan else 0)
        return MetricsServer(registry, self.config.metrics_port, "coordinator")

    def run(self) -> int:
        started = time.monotonic()
        metrics = None
        try:
            metrics = self.serve_metrics()
            self.publish_plan()
            self.watch()
        except IMergeError as exc:
            log.error("%s", exc)
            return 1
        finally:
            if metrics is not None:
                metrics.close()
        log.info("job %s finished after %.1fs", self.config.job, time.monotonic() - started)
        return 0
