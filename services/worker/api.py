"""The public API: ``imerge.distribute(model)`` wraps a module for PS training.

    model = imerge.distribute(Net(), imerge.OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()          # gradients stream to the shards during backward
    model.close()                # waits for the last sync, leaves the job

There is no local optimizer step: the optimizer runs on the shards, and the
next forward waits, module by module, for the parameters it needs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
from typing import Any

import torch

from imerge.coordinator.store import Store
from imerge.errors import IMergeError, LayoutMismatchError, PlanError
from imerge.metrics import MetricsServer
from imerge.optim import OptimizerSpec
from imerge.planning import Layout, Plan, layout_of

from .config import WorkerConfig
from .engine import SyncEngine

log = logging.getLogger(__name__)


def layout_payload(layout: Layout, config: WorkerConfig) -> str:
    """What a worker submits: its layout and the scheduling options the plan depends on."""
    return json.dumps({"layout": json.loads(layout.to_json()),
                       "options": dataclasses.asdict(config.plan_options())})


def wait_plan(store: Store, config: WorkerConfig) -> Plan:
    payload = store.wait_event("plan:1", config.wait_timeout_s, "the coordinator to publish the plan")
    raw = json.loads(payload)
    if "error" in raw:
        raise (LayoutMismatchError if raw.get("kind") == "layout-mismatch" else PlanError)(raw["error"])
    return Plan.from_json(payload)


class Heartbeat:
    """Refreshes this worker's liveness key until stopped."""

    def __init__(self, store: Store, rank: int, ttl_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, rank, ttl_s), daemon=True,
                                        name=f"imerge-heartbeat-{rank}")
        self._thread.start()

    def _run(self, store: Store, rank: int, ttl_s: float) -> None:
        while not self._stop.wait(ttl_s / 3):
            try:
                store.heartbeat(rank, ttl_s)
            except IMergeError as exc:
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class DistributedModel(torch.nn.Module):
    """A module whose parameters are trained by the PS shards of an IMerge job."""

    def __init__(self, module: torch.nn.Module, config: WorkerConfig, optimizer: OptimizerSpec):
        super().__init__()
        self.module = module
        self.config = config
        self._store = Store(config.redis_url, config.job)
        self._store.register_worker(config.rank, {"host": socket.gethostname(), "pid": os.getpid()},
                                    config.heartbeat_ttl_s)
        self._heartbeat = Heartbeat(self._store, config.rank, config.heartbeat_ttl_s)
        self._engine: SyncEngine | None = None
        self._metrics: MetricsServer | None = None
        try:
            layout = layout_of(module)
            self._store.submit_layout(config.rank, layout_payload(layout, config))
            self.plan = wait_plan(self._store, config)
            self._engine = SyncEngine(module, [p.name for p in layout.params], self.plan, config, optimizer,
                                      self._store)
            self._metrics = MetricsServer(self._engine.metrics.registry, config.metrics_port,
                                          f"worker {config.rank}")
            self._engine.initialize()
        except BaseException:
            self.abort()
            raise
        log.info("worker %d/%d joined job %s: %d groups on %d shards", config.rank, config.world_size,
                 config.job, len(self.plan.groups), len(self.plan.shard_addresses))

    @property
    def metrics_port(self) -> int:
        """The port of this worker's /metrics (-1: off)."""
        return self._metrics.port if self._metrics is not None else -1

    @property
    def engine(self) -> SyncEngine:
        if self._engine is None:
            raise IMergeError("this DistributedModel is closed")
        return self._engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine  # fail loudly once closed
        return self.module(*args, **kwargs)

    def synchronize(self) -> None:
        """Wait for every in-flight sync, so the parameters are the shards' latest."""
        self.engine.synchronize()

    def abort(self) -> None:
        """Leave at once: no final sync, no done mark (the others will time out naming this worker)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._heartbeat.stop()
        self._store.close()

    def close(self) -> None:
        """Finish the last sync, tell the coordinator this worker is done, release resources."""
        if self._engine is None:
            return
        try:
            self._engine.synchronize()
            self._store.mark_done(self.config.rank)
        finally:
            self.abort()

    def __enter__(self) -> "DistributedModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


def distribute(module: torch.nn.Module, optimizer: OptimizerSpec | None = None,
               config: WorkerConfig | None = None, **options: Any) -> DistributedModel:
    """Join the IMerge job described by ``config`` (default: ``IMERGE_*`` variables plus ``options``).

    ``optimizer`` runs on the shards (default: plain SGD, lr 0.01). Rank 0's
    optimizer and initial parameters are the ones the shards keep.
    """
    from imerge.config import from_env

    if config is None:
        config = from_env(WorkerConfig, **options)
    elif options:
        raise IMergeError("pass either a WorkerConfig or keyword options, not both")
    return DistributedModel(module, config, optimizer or OptimizerSpec())
