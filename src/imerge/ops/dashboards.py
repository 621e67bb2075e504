"""The Grafana dashboards, generated: ``python -m imerge.ops.deploygen`` writes them into deploy/.

Each dashboard is a list of panels, each panel a few PromQL expressions over the
metrics and recording rules (deploy/prometheus/rules.yml), with a unit, a
description and thresholds. Every dashboard has the variables ``datasource``
(any Prometheus: a cluster Grafana loading them through its sidecar picks its
own), ``namespace`` (Kubernetes'; All where there is none), ``job`` (the
``imerge_job`` label), ``shard`` and ``worker``; every query is filtered by
them and keeps namespaces apart. Every rate's window is Grafana's
``$__rate_interval`` (at least four scrape intervals), never a fixed one. The
tests run every expression, the variables set, against a real Prometheus
scraping real jobs.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DEFAULT_DATASOURCE_UID = "imerge-prometheus"  # the provisioned one (deploy/grafana/provisioning)
JOB = 'namespace=~"$namespace", imerge_job=~"$job"'
SHARD = JOB + ', shard=~"$shard"'
WORKER = JOB + ', worker=~"$worker"'
GREEN = {"color": "green", "value": None}


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    kind: str                            # timeseries, gauge, stat, bargauge, heatmap
    unit: str
    queries: list[tuple[str, str]]       # (PromQL, legend)
    description: str
    thresholds: tuple[dict[str, Any], ...] = (GREEN,)


def p90(metric: str, by: str, selector: str) -> str:
    return (f"histogram_quantile(0.9, sum by (namespace, {by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))")


def rate(metric: str, by: str, selector: str) -> str:
    return f"sum by (namespace, {by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


BUSY = (GREEN, {"color": "yellow", "value": 0.7}, {"color": "red", "value": 0.95})  # a link near saturation
SLOW = (GREEN, {"color": "yellow", "value": 1.0}, {"color": "red", "value": 5.0})     # seconds of waiting
OVERVIEW = [
    Panel("Efficiency against the bound", "gauge", "percentunit", [(f"job:imerge_efficiency:ratio{{{JOB}}}",
                                                                     "{{imerge_job}}")],
          "The bound, max(compute, worker link time, shard link time) per iteration, over the slowest worker's "
          "iteration time: 100% runs at the bound.",
          ({"color": "red", "value": None}, {"color": "yellow", "value": 0.5}, {"color": "green", "value": 0.8})),
    Panel("Iteration time and its bound", "timeseries", "s",
          [(f"job:imerge_iteration_seconds:mean1m{{{JOB}}}", "{{imerge_job}} iteration (slowest worker)"),
           (f"job:imerge_bound_seconds:mean1m{{{JOB}}}", "{{imerge_job}} bound")],
          "The slowest worker's mean iteration time, and the bound it is measured against."),
    Panel("Iteration time per worker", "timeseries", "s",
          [(f"worker:imerge_worker_iteration_seconds:mean1m{{{WORKER}}}", "worker {{worker}}")],
          "Mean time from one forward's start to the next, per worker (1 minute window)."),
    Panel("Samples per second", "timeseries", "short", [(f"job:imerge_samples:rate1m{{{JOB}}}", "samples/s")],
          "Samples in the workers' input batches per second, all workers together."),
    Panel("Plan version", "stat", "none",
          [(f"max by (namespace, imerge_job) (imerge_coordinator_plan_version{{{JOB}}})", "plan")],
          "The plan the coordinator published last (a cost plan replaces the first one after profiling)."),
    Panel("Live members", "stat", "none", [(f"imerge_coordinator_live_workers{{{JOB}}}", "workers"),
                                           (f"imerge_coordinator_live_shards{{{JOB}}}", "shards")],
          "Workers whose heartbeat the coordinator sees, and shards registered with it.", ({"color": "red", "value": None},
                                                                       {"color": "green", "value": 1})),
]
SHARDS = [
    Panel("Link utilization per shard", "timeseries", "percentunit",
          [(f"shard:imerge_link_utilization:ratio{{{SHARD}}}", "shard {{shard}}")],
          "The busier direction of each shard's link, from its byte counters, over --link-mbps.", BUSY),
    Panel("Link utilization heatmap", "heatmap", "percentunit",
          [(f"shard:imerge_link_utilization:ratio{{{SHARD}}}", "shard {{shard}}")],
          "The same, as a heatmap: a shard much busier than the others is a placement imbalance.", BUSY),
    Panel("Interface utilization (kernel counters)", "timeseries", "percentunit",
          [(f"instance:imerge_interface_utilization:ratio{{{JOB}}}", "{{role}} {{interface}}")],
          "Each role's network interfaces (but lo), from the kernel's counters of its namespace or container.",
          BUSY),
    Panel("Bytes per second per shard", "timeseries", "Bps",
          [(f"shard:imerge_shard_received_bytes:rate1m{{{SHARD}}}", "shard {{shard}} received"),
           (f"shard:imerge_shard_sent_bytes:rate1m{{{SHARD}}}", "shard {{shard}} sent")],
          "Gradient bytes received in counted pushes and parameter bytes sent in pulls, per shard."),
    Panel("Planned load (mapping table)", "bargauge", "bytes",
          [(f"sum by (namespace, shard) (imerge_shard_planned_bytes{{{SHARD}}})", "shard {{shard}}")],
          "The bytes of the blocks the plan maps to each shard."),
    Panel("Pushes in flight", "timeseries", "short",
          [(f"sum by (namespace, shard) (imerge_shard_pushes_in_flight{{{SHARD}}})", "shard {{shard}}")],
          "Push streams a shard is receiving now: many at once is an incast."),
    Panel("Rounds per second", "timeseries", "short", [(rate("imerge_shard_rounds_total", "shard", SHARD),
                                                          "shard {{shard}}")],
          "Completed aggregations (a block's round) per second, per shard."),
    Panel("Aggregation, optimizer step and pull wait, p90", "timeseries", "s",
          [(p90("imerge_shard_aggregation_seconds", "shard", SHARD), "shard {{shard}} aggregation"),
           (p90("imerge_shard_optimizer_step_seconds", "shard", SHARD), "shard {{shard}} optimizer step"),
           (p90("imerge_shard_pull_wait_seconds", "shard", SHARD), "shard {{shard}} pull wait")],
          "A shard's CPU per round (averaging, the optimizer) and how long pulls wait for the last push.", SLOW),
]
SCHEDULER = [
    Panel("Flag wait, mean per worker", "timeseries", "s",
          [(f"worker:imerge_worker_flag_wait_seconds:mean1m{{{WORKER}}}", "worker {{worker}}")],
          "Time a worker waits for a slot flag before pushing (--slots fixed or ack).", SLOW),
    Panel("Flag wait, p90 per worker", "timeseries", "s",
          [(p90("imerge_worker_flag_wait_seconds", "worker", WORKER), "worker {{worker}}")],
          "The 90th percentile of the same.", SLOW),
    Panel("Slot occupancy per group", "timeseries", "percentunit",
          [(f"group:imerge_slot_occupancy:ratio{{{JOB}}}", "group {{group}}")],
          "The fraction of time a group's flags are held, all workers together."),
    Panel("Groups synced per iteration", "timeseries", "short",
          [(f"job:imerge_groups_per_iteration:mean1m{{{JOB}}}", "groups per iteration")],
          "Groups pushed and pulled per iteration: the group count with T = 1, fewer with T > 1."),
    Panel("Compression ratio: fp32 bytes / wire bytes", "timeseries", "short",
          [(f"{rate('imerge_worker_uncompressed_bytes_total', 'direction', WORKER)} / "
            f"{rate('imerge_worker_wire_bytes_total', 'direction', WORKER)}", "{{direction}}")],
          "What --compression saves, per direction: 1 without compression, 2 with fp16 or bf16."),
    Panel("Bytes per second per group, before and after compression", "timeseries", "Bps",
          [(rate("imerge_worker_uncompressed_bytes_total", "group", WORKER), "group {{group}} fp32"),
           (rate("imerge_worker_wire_bytes_total", "group", WORKER), "group {{group}} on the wire")],
          "The bytes of each group's pushes and pulls in fp32, and on the wire."),
    Panel("Flags per second", "timeseries", "short",
          [(rate("imerge_coordinator_flags_granted_total", "imerge_job", JOB), "granted"),
           (rate("imerge_coordinator_flags_contended_total", "imerge_job", JOB), "contended"),
           (rate("imerge_coordinator_flags_expired_total", "imerge_job", JOB), "expired (lease)")],
          "Slot flags granted, granted after a wait, and taken back because a holder's lease ran out.",
          (GREEN, {"color": "red", "value": 0.1})),
    Panel("Seconds per iteration: predicted by --tune, and measured", "timeseries", "s",
          [(f"max by (namespace, imerge_job) (imerge_schedule_predicted_seconds{{{JOB}}})",
            "{{imerge_job}} predicted"),
           (f"job:imerge_iteration_seconds:mean1m{{{JOB}}}", "{{imerge_job}} measured (slowest worker)")],
          "The seconds per iteration the coordinator's simulation predicted for the schedule --tune chose, beside "
          "the slowest worker's measured mean. A measured time well above the prediction: the cluster is not the "
          "one the decision assumed (give the coordinator --link-gbit, --queue-kb or a --calibration)."),
    Panel("Schedule chosen by --tune", "table", "none",
          [(f"max by (namespace, imerge_job, fusion, priority, slots) (imerge_schedule_info{{{JOB}}})", "")],
          "The knob values --tune chose for the job (a knob an option gave reads 'given')."),
]
WORKERS = [
    Panel("Compute and exposed communication per iteration", "timeseries", "s",
          [(f"worker:imerge_worker_compute_seconds:mean1m{{{WORKER}}}", "worker {{worker}} compute"),
           (f"worker:imerge_worker_forward_wait_seconds:mean1m{{{WORKER}}}", "worker {{worker}} exposed comm")],
          "Forward and backward time, and the time a forward waited for parameters (communication not hidden)."),
    Panel("Iteration time, p90", "timeseries", "s",
          [(p90("imerge_worker_iteration_seconds", "worker", WORKER), "worker {{worker}}")],
          "The 90th percentile of each worker's iteration time."),
    Panel("Bytes per second pushed and pulled", "timeseries", "Bps",
          [(rate("imerge_worker_pushed_bytes_total", "worker", WORKER), "worker {{worker}} pushed"),
           (rate("imerge_worker_pulled_bytes_total", "worker", WORKER), "worker {{worker}} pulled")],
          "What each worker moves on the wire, all shards together."),
    Panel("Link time per iteration", "timeseries", "s",
          [(f"worker:imerge_link_seconds_per_iteration:mean1m{{{WORKER}}}", "worker {{worker}}")],
          "Seconds per iteration a worker's link needs for its busier direction, at --link-mbps."),
    Panel("Loss", "timeseries", "short", [(f"imerge_worker_loss{{{WORKER}}}", "worker {{worker}}")],
          "The latest loss each worker reported (the built-in job every iteration; a script with model.log_loss)."),
    Panel("Learning rate per parameter group", "timeseries", "short",
          [(f"max by (namespace, param_group) (imerge_worker_learning_rate{{{WORKER}}})",
            "group {{param_group}}")],
          "The learning rate each round's pushes carried to the shards (a scheduler's, as it steps)."),
    Panel("CPU and memory per process", "timeseries", "short",
          [(rate("process_cpu_seconds_total", "role", JOB), "{{role}} CPU cores"),
           (f"sum by (namespace, role) (process_resident_memory_bytes{{{JOB}}}) / 2^30", "{{role}} GiB resident")],
          "CPU cores busy and resident memory of every IMerge process (prometheus_client's process collector)."),
]
DASHBOARDS: dict[str, tuple[str, list[Panel]]] = {
    "imerge-overview": ("IMerge: job overview", OVERVIEW),
    "imerge-shards": ("IMerge: shards", SHARDS),
    "imerge-scheduler": ("IMerge: scheduler", SCHEDULER),
    "imerge-workers": ("IMerge: workers", WORKERS),
}


def panel(panel_id: int, spec: Panel) -> dict[str, Any]:
    width = 12
    return {
        "id": panel_id, "type": spec.kind, "title": spec.title, "description": spec.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": ((panel_id - 1) % 2) * width, "y": ((panel_id - 1) // 2) * 8},
        "fieldConfig": {"defaults": {"unit": spec.unit, "thresholds": {"mode": "absolute",
                                                                        "steps": list(spec.thresholds)}},
                        "overrides": []},
        "options": {"calculate": False} if spec.kind == "heatmap" else {},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "format": "time_series"} for i, (expr, legend) in enumerate(spec.queries)],
    }


def variable(name: str, label: str, metric: str, selector: str, multi: bool, include_all: bool = False
             ) -> dict[str, Any]:
    query = f"label_values({metric}{{{selector}}}, {label})" if selector else f"label_values({metric}, {label})"
    return {"name": name, "label": name, "type": "query", "datasource": DATASOURCE, "refresh": 2, "sort": 3,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "multi": multi, "includeAll": multi or include_all, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"} if multi or include_all else {}}


def templating() -> dict[str, Any]:
    return {"list": [
        {"name": "datasource", "label": "data source", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus", "value": DEFAULT_DATASOURCE_UID}, "refresh": 1},
        variable("namespace", "namespace", "imerge_worker_iterations_total", "", multi=False, include_all=True),
        variable("job", "imerge_job", "imerge_worker_iterations_total", 'namespace=~"$namespace"', multi=False),
        variable("shard", "shard", "imerge_shard_rounds_total", JOB, multi=True),
        variable("worker", "worker", "imerge_worker_iterations_total", JOB, multi=True),
    ]}


def dashboard(uid: str) -> dict[str, Any]:
    title, panels = DASHBOARDS[uid]
    return {
        "uid": uid, "title": title, "tags": ["imerge"], "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-15m", "to": "now"}, "refresh": "5s", "timezone": "browser",
        "templating": templating(),
        "links": [{"title": "IMerge dashboards", "type": "dashboards", "tags": ["imerge"], "asDropdown": True,
                   "includeVars": True, "keepTime": True}],
        "panels": [panel(i + 1, spec) for i, spec in enumerate(panels)],
    }


def expressions(variables: dict[str, str] | None = None) -> list[str]:
    """Every panel's PromQL, with ``$name`` replaced by ``variables[name]`` (for the tests and for a reader)."""
    found = [expr for _, panels in DASHBOARDS.values() for spec in panels for expr, _ in spec.queries]
    for name, value in sorted((variables or {}).items(), key=lambda item: -len(item[0])):
        found = [expr.replace(f"${name}", value) for expr in found]
    return found


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(dashboard(uid), indent=2) + "\n" for uid in DASHBOARDS}
