"""The Grafana dashboards, generated: ``python -m imerge.ops.deploygen`` writes them into deploy/.

Each dashboard is a list of panels, each panel a few PromQL expressions over the
metrics and recording rules (deploy/prometheus/rules.yml). Every panel uses the
provisioned data source (uid ``imerge-prometheus``); the tests run every
expression against a real Prometheus scraping a real job.
"""
from __future__ import annotations

import json
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "imerge-prometheus"}


def p90(metric: str, by: str) -> str:
    return f"histogram_quantile(0.9, sum by ({by}, le) (rate({metric}_bucket[1m])))"


# dashboard uid -> (title, [(panel title, kind, unit, [(expr, legend)])])
DASHBOARDS: dict[str, tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = {
    "imerge-overview": ("IMerge: job overview", [
        ("Iteration time per worker", "timeseries", "s",
         [("worker:imerge_worker_iteration_seconds:mean1m", "worker {{worker}}")]),
        ("Samples per second", "timeseries", "none", [("job:imerge_samples:rate1m", "samples/s")]),
        ("Efficiency against the bound", "gauge", "percentunit", [("job:imerge_efficiency:ratio", "efficiency")]),
        ("Iteration time and its bound", "timeseries", "s",
         [("job:imerge_iteration_seconds:mean1m", "iteration (slowest worker)"),
          ("job:imerge_bound_seconds:mean1m", "bound: max(compute, worker link, shard link)")]),
        ("Plan version", "stat", "none", [("imerge_coordinator_plan_version", "plan")]),
        ("Live members", "stat", "none", [("imerge_coordinator_live_members", "{{role}}")]),
    ]),
    "imerge-shards": ("IMerge: shards", [
        ("Link utilization per shard", "timeseries", "percentunit",
         [("shard:imerge_link_utilization:ratio", "shard {{shard}}")]),
        ("Link utilization heatmap", "heatmap", "percentunit",
         [("shard:imerge_link_utilization:ratio", "shard {{shard}}")]),
        ("Interface utilization (kernel counters)", "timeseries", "percentunit",
         [("instance:imerge_interface_utilization:ratio", "{{role}} {{interface}}")]),
        ("Bytes per second per shard", "timeseries", "Bps",
         [("shard:imerge_shard_received_bytes:rate1m", "shard {{shard}} received"),
          ("shard:imerge_shard_sent_bytes:rate1m", "shard {{shard}} sent")]),
        ("Planned load (mapping table)", "bargauge", "bytes",
         [("sum by (shard) (imerge_shard_planned_bytes)", "shard {{shard}}")]),
        ("Pushes in flight", "timeseries", "none",
         [("sum by (shard) (imerge_shard_pushes_in_flight)", "shard {{shard}}")]),
        ("Rounds per second", "timeseries", "none",
         [("sum by (shard) (rate(imerge_shard_rounds_total[1m]))", "shard {{shard}}")]),
        ("Aggregation, optimizer step and pull wait, p90", "timeseries", "s",
         [(p90("imerge_shard_aggregation_seconds", "shard"), "shard {{shard}} aggregation"),
          (p90("imerge_shard_optimizer_step_seconds", "shard"), "shard {{shard}} optimizer step"),
          (p90("imerge_shard_pull_wait_seconds", "shard"), "shard {{shard}} pull wait")]),
    ]),
    "imerge-scheduler": ("IMerge: scheduler", [
        ("Flag wait, mean per worker", "timeseries", "s",
         [("worker:imerge_worker_flag_wait_seconds:mean1m", "worker {{worker}}")]),
        ("Flag wait, p90 per worker", "timeseries", "s",
         [(p90("imerge_worker_flag_wait_seconds", "worker"), "worker {{worker}}")]),
        ("Slot occupancy per group", "timeseries", "percentunit",
         [("group:imerge_slot_occupancy:ratio", "group {{group}}")]),
        ("Groups synced per iteration", "timeseries", "none",
         [("job:imerge_groups_per_iteration:mean1m", "groups per iteration")]),
        ("Compression ratio: fp32 bytes / wire bytes (--compression)", "timeseries", "none",
         [("sum by (direction) (rate(imerge_worker_uncompressed_bytes_total[1m])) / "
           "sum by (direction) (rate(imerge_worker_wire_bytes_total[1m]))", "{{direction}}")]),
        ("Bytes per second per group, before and after compression", "timeseries", "Bps",
         [("sum by (group) (rate(imerge_worker_uncompressed_bytes_total[1m]))", "group {{group}} fp32"),
          ("sum by (group) (rate(imerge_worker_wire_bytes_total[1m]))", "group {{group}} on the wire")]),
        ("Flags per second", "timeseries", "none",
         [("rate(imerge_coordinator_flags_granted_total[1m])", "granted"),
          ("rate(imerge_coordinator_flags_contended_total[1m])", "contended"),
          ("rate(imerge_coordinator_flags_expired_total[1m])", "expired (lease)")]),
    ]),
    "imerge-workers": ("IMerge: workers", [
        ("Compute and exposed communication per iteration", "timeseries", "s",
         [("worker:imerge_worker_compute_seconds:mean1m", "worker {{worker}} compute"),
          ("worker:imerge_worker_forward_wait_seconds:mean1m", "worker {{worker}} exposed comm")]),
        ("Iteration time, p90", "timeseries", "s",
         [(p90("imerge_worker_iteration_seconds", "worker"), "worker {{worker}}")]),
        ("Bytes per second pushed and pulled", "timeseries", "Bps",
         [("sum by (worker) (rate(imerge_worker_pushed_bytes_total[1m]))", "worker {{worker}} pushed"),
          ("sum by (worker) (rate(imerge_worker_pulled_bytes_total[1m]))", "worker {{worker}} pulled")]),
        ("Link time per iteration", "timeseries", "s",
         [("worker:imerge_link_seconds_per_iteration:mean1m", "worker {{worker}}")]),
    ]),
}


def panel(panel_id: int, title: str, kind: str, unit: str, queries: list[tuple[str, str]]) -> dict[str, Any]:
    width = 12
    return {
        "id": panel_id, "type": kind, "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": ((panel_id - 1) % 2) * width, "y": ((panel_id - 1) // 2) * 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"calculate": False} if kind == "heatmap" else {},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "format": "time_series"} for i, (expr, legend) in enumerate(queries)],
    }


def dashboard(uid: str) -> dict[str, Any]:
    title, panels = DASHBOARDS[uid]
    return {
        "uid": uid, "title": title, "tags": ["imerge"], "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-15m", "to": "now"}, "refresh": "5s", "timezone": "browser",
        "links": [{"title": "IMerge dashboards", "type": "dashboards", "tags": ["imerge"], "asDropdown": True}],
        "panels": [panel(i + 1, *spec) for i, spec in enumerate(panels)],
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(dashboard(uid), indent=2) + "\n" for uid in DASHBOARDS}
