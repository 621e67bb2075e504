"""The worker's Prometheus metrics: where an iteration's time goes, and what it moves."""
from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from imerge.telemetry.metrics import SECONDS_BUCKETS, role_registry


class WorkerMetrics:
    def __init__(self, rank: int, link_mbps: float):
        self.registry = role_registry(link_mbps)
        self.rank = str(rank)
        registry, worker = self.registry, self.rank

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(name, help_text, ["worker"], buckets=SECONDS_BUCKETS,
                             registry=registry).labels(worker=worker)

        self.iteration = histogram("imerge_worker_iteration_seconds", "From one forward's start to the next's")
        self.compute = histogram("imerge_worker_compute_seconds",
                                 "Forward and backward of an iteration, without the time the forward waited")
        self.forward_wait = histogram("imerge_worker_forward_wait_seconds",
                                      "Time an iteration's forward waited for parameters (exposed communication)")
        self.flag_wait = histogram("imerge_worker_flag_wait_seconds", "Time spent waiting for a group's slot flag")
        self.iterations = Counter("imerge_worker_iterations", "Backward passes completed", ["worker"],
                                  registry=registry).labels(worker=worker)
        self.samples = Counter("imerge_worker_samples", "Samples in the forwards' input batches", ["worker"],
                               registry=registry).labels(worker=worker)
        self._pushed = Counter("imerge_worker_pushed_bytes", "Gradient bytes pushed, per shard",
                               ["worker", "shard"], registry=registry)
        self._pulled = Counter("imerge_worker_pulled_bytes", "Parameter bytes pulled, per shard",
                               ["worker", "shard"], registry=registry)
        self._group_syncs = Counter("imerge_worker_group_syncs", "Groups pushed and pulled", ["worker", "group"],
                                    registry=registry)
        self._flag_held = Counter("imerge_worker_flag_held_seconds", "Time this worker held a group's slot flag",
                                  ["worker", "group"], registry=registry)
        self._raw = Counter("imerge_worker_uncompressed_bytes", "Bytes a group's pushes (direction push) and pulls "
                            "(direction pull) would have moved in fp32", ["worker", "group", "direction"],
                            registry=registry)
        self._wire = Counter("imerge_worker_wire_bytes", "Bytes a group's pushes and pulls moved on the wire, after "
                             "compression (--compression)", ["worker", "group", "direction"], registry=registry)
        self.loss = Gauge("imerge_worker_loss", "The latest loss the training loop reported (model.log_loss; the "
                          "built-in job reports every iteration's)", ["worker"], registry=registry).labels(worker=worker)
        self._learning_rate = Gauge("imerge_worker_learning_rate", "The learning rate of each parameter group, as "
                                    "the latest push carried it", ["worker", "param_group"], registry=registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # (metric's id, label values) -> child
        self.groups_synced = Gauge("imerge_worker_groups_synced", "Groups the last iteration pushed",
                                   ["worker"], registry=registry).labels(worker=worker)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric``'s child for this worker and ``labels``, looked up once (the comm loop counts every push and
        pull: prometheus_client's ``labels`` validates and locks on each call)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.rank, *labels)
        return child

    def pushed(self, shard: int, nbytes: int) -> None:
        self._child(self._pushed, str(shard)).inc(nbytes)

    def pulled(self, shard: int, nbytes: int) -> None:
        self._child(self._pulled, str(shard)).inc(nbytes)

    def moved(self, group: int, direction: str, raw_bytes: int, wire_bytes: int) -> None:
        """Bytes of a group's push or pull before and after compression (called per block)."""
        self._child(self._raw, str(group), direction).inc(raw_bytes)
        self._child(self._wire, str(group), direction).inc(wire_bytes)

    def learning_rates(self, rates: list[float]) -> None:
        for index, rate in enumerate(rates):
            self._child(self._learning_rate, str(index)).set(rate)

    def group_synced(self, group: int) -> None:
        self._child(self._group_syncs, str(group)).inc()

    def flag_held(self, group: int, seconds: float) -> None:
        self._child(self._flag_held, str(group) if group >= 0 else "port").inc(seconds)
