"""The coordinator's Prometheus metrics, read from the store at scrape time (one truth: Redis)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from imerge.core.errors import IMergeError
from imerge.core.knobs import JOB_KNOBS
from imerge.core.planning import Plan
from imerge.telemetry.metrics import role_registry

from imerge.control.store import FLAG_STATS, StoreBase

log = logging.getLogger(__name__)
FLAG_HELP = {"granted": "Slot flags granted", "contended": "Slot flags granted after waiting for another holder",
             "expired": "Slot flags whose lease expired before the holder released them"}


class _CoordinatorCollector(Collector):
    def __init__(self, store: StoreBase, members: tuple[int, int], plan: Callable[[], Plan | None],
                 generation: Callable[[], int], retuning: Callable[[], tuple[int, int] | None]):
        self.store, (self.num_workers, self.num_shards), self.plan = store, members, plan
        self.generation, self.retuning = generation, retuning

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        plan = self.plan()
        yield GaugeMetricFamily("imerge_coordinator_plan_version", "Version of the latest published plan",
                                value=plan.version if plan else 0)
        if plan is not None and plan.predicted_s > 0:  # --tune decided
            yield GaugeMetricFamily("imerge_schedule_predicted_seconds", "Seconds per iteration the simulator "
                                    "predicted for the schedule --tune chose", value=plan.predicted_s)
            knobs = dict(plan.knobs)
            yield InfoMetricFamily("imerge_schedule", "The schedule --tune chose (a knob not tuned: given)",
                                   value={knob: knobs.get(knob, "given") for knob in JOB_KNOBS})
        counts = self.retuning()
        if counts is not None:  # online re-tuning
            yield CounterMetricFamily("imerge_schedule_evaluations", "Times online re-tuning decided again after "
                                      "the job drifted from its schedule's expected time", value=counts[0])
            yield CounterMetricFamily("imerge_schedule_switches", "Times online re-tuning switched the schedule",
                                      value=counts[1])
        yield from self._expected(plan)
        yield GaugeMetricFamily("imerge_coordinator_generation", "The job generation (recoveries so far)",
                                value=self.generation())
        try:
            stats = self.store.flag_stats()
            live_workers = len(self.store.member_generations(self.num_workers, 0))
            shards = self.store.registered_shards()
        except IMergeError as exc:  # Redis unreachable: export nothing rather than stale figures
            log.warning("metrics: cannot read the store: %s", exc)
            return
        for name in FLAG_STATS:
            yield CounterMetricFamily(f"imerge_coordinator_flags_{name}", FLAG_HELP[name], value=stats[name])
        yield GaugeMetricFamily("imerge_coordinator_live_workers", "Workers with a live heartbeat",
                                value=live_workers)
        yield GaugeMetricFamily("imerge_coordinator_live_shards", "Shards registered in the store", value=shards)

    def _expected(self, plan: Plan | None) -> Iterator[GaugeMetricFamily]:
        """The members the job needs, the alerts' reference. The role is in the name, not in a label: every
        scrape configuration that ships sets a target label ``role``, which would shadow a metric's own."""
        yield GaugeMetricFamily("imerge_coordinator_expected_workers", "Workers the job's plan has (before the "
                                "first plan: --num-workers)", value=plan.num_workers if plan else self.num_workers)
        yield GaugeMetricFamily("imerge_coordinator_expected_shards", "PS shards the job's plan has (before the "
                                "first plan: --num-shards)",
                                value=len(plan.shard_addresses) if plan else self.num_shards)


def coordinator_registry(store: StoreBase, members: tuple[int, int], link_mbps: float, plan: Callable[[], Plan | None],
                         generation: Callable[[], int],
                         retuning: Callable[[], tuple[int, int] | None] = lambda: None) -> CollectorRegistry:
    registry = role_registry(link_mbps)
    registry.register(_CoordinatorCollector(store, members, plan, generation, retuning))
    return registry
