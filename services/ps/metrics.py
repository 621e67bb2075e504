"""The shard's Prometheus metrics.

The counters are the shard's own :class:`ShardCounters` (also answered by the
Stats RPC), read at scrape time so there is one truth; latencies are histograms
observed where they happen.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

from prometheus_client import Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from imerge.telemetry.metrics import SECONDS_BUCKETS, role_registry



@dataclasses.dataclass
class ShardCounters:
    bytes_received: int = 0
    bytes_sent: int = 0
    pushes: int = 0
    duplicate_pushes: int = 0
    pulls: int = 0
    rounds_completed: int = 0
    rejected: int = 0
    fenced_pushes: int = 0
    second_writers: int = 0
    stale_generation: int = 0
    checkpoints_written: int = 0
    checkpoint_failures: int = 0
    strangers_ended: int = 0
    pull_turn_waits: int = 0
    pull_turn_wait_s: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """Add to counters from any thread (the event loop and the data connections' threads count)."""
        with self._lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)


COUNTERS = (  # (ShardCounters field, metric name without _total, help)
    ("bytes_received", "imerge_shard_received_bytes", "Gradient bytes received in counted pushes"),
    ("bytes_sent", "imerge_shard_sent_bytes", "Parameter bytes sent in pulls and fetches"),
    ("pushes", "imerge_shard_pushes", "Pushes counted (one per block, worker and round)"),
    ("duplicate_pushes", "imerge_shard_duplicate_pushes", "Pushes of an already counted round, acknowledged "
                                                          "and not applied"),
    ("pulls", "imerge_shard_pulls", "Pulls answered or waited on (one per block)"),
    ("rounds_completed", "imerge_shard_rounds", "Aggregations completed (block rounds)"),
    ("rejected", "imerge_shard_rejected_requests", "Requests answered with an error status"),
    ("fenced_pushes", "imerge_shard_fenced_pushes", "Pushes rejected because their slot flag's fencing token "
                                                    "was older than one the block had seen (a late holder)"),
    ("second_writers", "imerge_shard_second_writer_pushes", "Pushes refused because the row they name already "
                                                            "holds different data of that round (two clients push "
                                                            "as one worker)"),
    ("stale_generation", "imerge_shard_stale_generation_requests", "Requests of an older job generation, "
                                                                    "rejected and never applied"),
    ("checkpoints_written", "imerge_shard_checkpoints", "Checkpoints written completely"),
    ("checkpoint_failures", "imerge_shard_checkpoint_failures", "Checkpoint writes that failed (disk full, "
                                                                "permissions): the previous checkpoint stands"),
    ("strangers_ended", "imerge_shard_data_connections_ended_before_hello", "Data connections ended before a valid "
                                                                            "HELLO: past --handshake-timeout-s, or "
                                                                            "evicted to make room for newer ones"),
    ("pull_turn_waits", "imerge_shard_pull_turn_waits", "Pulled blocks that waited for a pull asked before theirs "
                                                        "to drain from this host's uplink queue (--pull-order)"),
    ("pull_turn_wait_s", "imerge_shard_pull_turn_wait_seconds", "Seconds pulled blocks waited so (--pull-order)"),
)


class _CountersCollector(Collector):
    def __init__(self, index: int, counters: ShardCounters):
        self.index, self.counters = str(index), counters

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field, name, help_text in COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["shard"])
            family.add_metric([self.index], getattr(self.counters, field))
            yield family


class ShardMetrics:
    """Histograms and gauges of one shard, in a registry of their own."""

    def __init__(self, index: int, counters: ShardCounters, link_mbps: float):
        self.registry = role_registry(link_mbps)
        self.registry.register(_CountersCollector(index, counters))
        shard = str(index)

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(name, help_text, ["shard"], buckets=SECONDS_BUCKETS,
                             registry=self.registry).labels(shard=shard)

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, ["shard"], registry=self.registry).labels(shard=shard)

        self.aggregation = histogram("imerge_shard_aggregation_seconds",
                                     "Summing a block's pushed gradients in worker-id order")
        self.optimizer_step = histogram("imerge_shard_optimizer_step_seconds", "The optimizer step of a block")
        self.pull_wait = histogram("imerge_shard_pull_wait_seconds",
                                   "Time a pull waited for the round's last push and its aggregation")
        self.pushes_in_flight = gauge("imerge_shard_pushes_in_flight", "Pushes being received now")
        self.planned_bytes = gauge("imerge_shard_planned_bytes",
                                   "Parameter bytes the mapping table assigns to this shard (its planned load)")
        self.blocks = gauge("imerge_shard_blocks", "Blocks held by this shard")
        self.generation = gauge("imerge_shard_generation", "The job generation this shard serves")
        self.checkpoint_round = gauge("imerge_shard_checkpoint_round", "Round of the newest complete checkpoint")
        self.checkpoint_write = histogram("imerge_shard_checkpoint_write_seconds",
                                          "Writing one checkpoint (tensors, manifest, fsync, rename)")
