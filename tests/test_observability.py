"""Observability: metrics that agree with the truth, a real Prometheus scraping a real job,
recording rules and dashboards whose every expression returns data, and ``imerge top``."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

import imerge
from imerge.core.planning import FIRST_PLAN
from imerge.ops.dashboards import DEFAULT_DATASOURCE_UID, expressions as dashboard_expressions, render
from imerge.ops.redis_server import free_port
from imerge.workloads.models import build_model
from imerge.core.optim import OptimizerSpec
from imerge.ops.top import scrape

from helpers import LocalCluster, one_process_at_a_time

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
IMERGE = [sys.executable, "-m", "imerge"]


@pytest.fixture(scope="module")
def promtool() -> dict[str, str]:
    """Debian's prometheus and promtool, installed when missing (root)."""
    with one_process_at_a_time("apt-get"):
        if shutil.which("prometheus") is None or shutil.which("promtool") is None:
            if os.geteuid() != 0 or shutil.which("apt-get") is None:
                pytest.skip("prometheus is not installed and cannot be installed here (needs root and apt-get)")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
            if subprocess.run(command, env=env, capture_output=True, timeout=600).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
                result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
                assert result.returncode == 0, f"apt-get install prometheus failed: {result.stderr[-2000:]}"
    return {"prometheus": shutil.which("prometheus"), "promtool": shutil.which("promtool")}


# -- metrics agree with the truth ------------------------------------------------------------
def test_metrics_agree_with_the_truth(redis_url):
    steps, workers, batch = 6, 2, 16
    cluster = LocalCluster(redis_url, workers, 2)
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(batch, 1, 8, 8, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
            for _ in range(steps)]
    try:
        def body(rank: int):
            model = imerge.distribute(build_model("digits-cnn", seed=0), OptimizerSpec("sgd", lr=0.05),
                                      cluster.worker_config(rank, fusion="size", size_cap_mib=0.02,
                                                            first_cap_mib=0.005, partition_mib=0.02, slots="ack",
                                                            slot_scope="group", slot_width=1))
            registry = model.engine.metrics.registry
            over_http = scrape(f"127.0.0.1:{model.metrics_port}", 5)
            scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5)
            for x, y in data:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                model.log_loss(loss)
                model.optimizer.step()  # nothing left to do (the shards stepped), as in a DDP loop
                scheduler.step()
            model.close()
            assert registry.get_sample_value("imerge_worker_loss", {"worker": str(rank)}) == loss.item()
            return registry, over_http

        results = cluster.run_workers(body)
        plan = cluster.coordinator.store.read_plan(FIRST_PLAN).plan
        assert len(plan.groups) > 1 and {b.shard for b in plan.blocks} == {0, 1}
        for index, server in enumerate(cluster.shards):
            shard = server.shard.metrics.registry
            labels = {"shard": str(index)}
            mapped = sum(b.numel for b in plan.blocks if b.shard == index) * 4
            assert shard.get_sample_value("imerge_shard_planned_bytes", labels) == mapped > 0
            pushed = sum(r.get_sample_value("imerge_worker_pushed_bytes_total", {"worker": str(rank), **labels})
                         for rank, (r, _) in enumerate(results))
            received = shard.get_sample_value("imerge_shard_received_bytes_total", labels)
            assert received == pushed == mapped * workers * steps
            assert shard.get_sample_value("imerge_shard_pushes_in_flight", labels) == 0
            assert shard.get_sample_value("imerge_shard_aggregation_seconds_count", labels) == \
                steps * sum(1 for b in plan.blocks if b.shard == index)
            over_http = scrape(f"127.0.0.1:{server.server.metrics.port}", 5)
            assert over_http[("imerge_shard_received_bytes_total", (("shard", str(index)),))] == received
        for rank, (registry, over_http) in enumerate(results):
            worker = {"worker": str(rank)}
            assert registry.get_sample_value("imerge_worker_iterations_total", worker) == steps
            assert registry.get_sample_value("imerge_worker_samples_total", worker) == steps * batch
            assert registry.get_sample_value("imerge_worker_iteration_seconds_count", worker) == steps - 1
            flags = sum(len({block.shard for block in plan.group_blocks(group)}) for group in plan.groups)
            assert registry.get_sample_value("imerge_worker_flag_wait_seconds_count", worker) == \
                steps * flags  # one slot per (group, shard) and iteration
            assert ("imerge_link_capacity_bytes_per_second", ()) in over_http
            assert any(name == "process_cpu_seconds_total" for name, _ in over_http)  # every role's process figures
            assert registry.get_sample_value("imerge_worker_learning_rate", {**worker, "param_group": "0"}) == \
                0.05 * 0.5 ** (steps - 1)  # the last backward's, after steps - 1 scheduler steps
        stats = cluster.coordinator.store.flag_stats()
        flags = sum(len({block.shard for block in plan.group_blocks(group)}) for group in plan.groups)
        assert stats["granted"] == workers * steps * flags
        assert 0 <= stats["contended"] <= stats["granted"] and stats["expired"] == 0
    finally:
        cluster.close()


# -- rules and dashboards, offline -------------------------------------------------------------------
def test_recording_rules_pass_promtool(promtool):
    for command in (["check", "rules", str(RULES)], ["test", "rules", str(RULES.with_name("rules_test.yml"))]):
        result = subprocess.run([promtool["promtool"], *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_says_what_happened_and_links_a_runbook_that_exists():
    import importlib.metadata

    from prometheus_client import generate_latest

    from imerge.telemetry.metrics import role_registry

    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} == {"IMergeNoProgress", "IMergeWorkerMissing", "IMergeShardMissing",
                                            "IMergeCoordinatorMissing", "IMergeTargetDown", "IMergeStraggler", "IMergeCheckpointFailures", "IMergeRecoveriesInARow",
                                            "IMergeFlagHeldPastLease"}
    runbooks = (ROOT / "docs" / "observability.md").read_text()
    tested = (RULES.with_name("rules_test.yml")).read_text()
    for alert in alerts:
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning")
        anchor = annotations["runbook_url"].rsplit("#", 1)[1]
        assert anchor == alert["alert"].lower() and f"\n### {alert['alert']}\n" in runbooks, alert["alert"]
        assert tested.count(f"alertname: {alert['alert']}") >= 2, alert["alert"]  # a case firing, one not
    exposition = generate_latest(role_registry(100.0)).decode()
    versions = f'torch_version="{torch.__version__}",version="{importlib.metadata.version("imerge")}"'
    assert f"imerge_build_info{{{versions}}} 1.0" in exposition


def test_dashboards_are_valid_generated_and_use_the_provisioned_source():
    assert sorted(p.name for p in DASHBOARD_DIR.glob("*.json")) == sorted(render())
    provisioned = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {source["uid"] for source in provisioned["datasources"]}
    for name, text in render().items():
        committed = (DASHBOARD_DIR / name).read_text()
        assert committed == text, f"{name} is stale: run python -m imerge.ops.deploygen"
        dashboard = json.loads(committed)
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"datasource", "namespace", "job", "shard", "worker"}, name
        assert variables["namespace"]["allValue"] == ".*"  # outside Kubernetes there is no namespace label
        assert variables["datasource"]["current"]["value"] == DEFAULT_DATASOURCE_UID and DEFAULT_DATASOURCE_UID in uids
        for panel in dashboard["panels"]:
            sources = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
            assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            assert panel["description"] and panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            assert panel["fieldConfig"]["defaults"]["thresholds"]["steps"], panel["title"]
            assert all('namespace=~"$namespace", imerge_job=~"$job"' in t["expr"] for t in panel["targets"]), \
                panel["title"]
            for target in panel["targets"]:  # every rate's window follows the scrape interval
                windows = re.findall(r"\[([^\]]+)\]", target["expr"])
                assert windows and set(windows) == {"$__rate_interval"} if "rate(" in target["expr"] else \
                    not windows, (panel["title"], target["expr"])
        # a Grafana whose Prometheus has another uid: every reference follows the variable, none is hard-coded
        loaded = json.loads(committed.replace("${datasource}", "cluster-prometheus"))
        references = [p["datasource"]["uid"] for p in loaded["panels"]] + [
            t["datasource"]["uid"] for p in loaded["panels"] for t in p["targets"]] + [
            v["datasource"]["uid"] for v in loaded["templating"]["list"] if "datasource" in v]
        assert set(references) == {"cluster-prometheus"}, name
        assert committed.count(DEFAULT_DATASOURCE_UID) == 1, name  # the variable's default only
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/imerge.yml").read_text())
    assert provider["providers"][0]["options"]["path"]


# -- a real Prometheus scraping a real job ----------------------------------------------------------
def dashboard_queries(namespace: str, job: str) -> list[str]:
    """Every dashboard query with the variables set to one job (all its shards and workers) and Grafana's rate
    window at this Prometheus's 1 s scrape interval."""
    return dashboard_expressions({"namespace": namespace, "job": job, "shard": ".*", "worker": ".*",
                                  "__rate_interval": "4s"})


def recording_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "record" in rule]


def expressions(namespace: str, job: str) -> list[str]:
    """Every dashboard query for one job, every recording rule."""
    return dashboard_queries(namespace, job) + [e for rule in recording_rules() for e in (rule["record"], rule["expr"])]


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def launch_job(log_dir) -> subprocess.Popen:
    return subprocess.Popen(IMERGE + ["launch", "--shards", "2", "--workers", "2", "--model", "digits-cnn",
                                      "--data", "digits", "--iters", "100000", "--fusion", "size",
                                      "--slots", "ack", "--slot-width", "1", "--log-dir", str(log_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# Labels a shipped scrape configuration (or Kubernetes service discovery) sets on its targets: a metric label of
# the same name would be stored as exported_<name>, out of the alerts' sight.
TARGET_LABELS = {"role", "imerge_job", "namespace", "job", "instance", "pod", "service", "endpoint", "container"}
AVAILABILITY = "IMergeWorkerMissing|IMergeShardMissing|IMergeCoordinatorMissing|IMergeTargetDown|IMergeNoProgress"


def active_alerts(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=10) as reply:
        return json.loads(reply.read())["data"]["alerts"]


def pending(port: int, name: str, value: float, **labels: str) -> dict | None:
    """The alert ``name`` with ``labels`` and ``value``, pending (its 'for' not over), if Prometheus has it."""
    return next((a for a in active_alerts(port) if a["labels"]["alertname"] == name and a["state"] == "pending"
                 and labels.items() <= a["labels"].items() and float(a["value"]) == value), None)


def see_alerts_when_members_stop(port: int, roles_file: Path, stopped: list[int]) -> None:
    """Stop (SIGSTOP: the launcher would restart a killed one) worker 1 of the job in namespace team-0, then its
    shard 1; each time its alerts go pending with the job's labels and the count, the other job's stay quiet.
    ``stopped`` gets each process as it is stopped (the caller continues them)."""
    roles = json.loads(roles_file.read_text())
    job = {"imerge_job": "train", "namespace": "team-0"}
    for role, alert in (("worker1", "IMergeWorkerMissing"), ("ps1", "IMergeShardMissing")):
        os.killpg(roles[role], signal.SIGSTOP)
        stopped.append(roles[role])
        wait_for(f"{alert} pending for team-0 with value 1 after {role} stopped",
                 lambda: pending(port, alert, 1.0, **job), 90)
        wait_for(f"IMergeTargetDown pending for {role}", lambda: pending(port, "IMergeTargetDown", 0.0, role=role, **job),
                 30)
    assert not [a for a in active_alerts(port) if a["labels"].get("namespace") == "team-1"
                and re.fullmatch(AVAILABILITY, a["labels"]["alertname"])], "the healthy job's alerts went off"


def merged_config(configs: list, path) -> tuple[list[str], list[str]]:
    """One Prometheus configuration scraping every job's targets as two releases of one name in two Kubernetes
    namespaces would be: the same job id (imerge_job), namespace team-0 and team-1; the targets and namespaces."""
    merged = yaml.safe_load(configs[0].read_text())
    static = []
    for index, config in enumerate(configs):
        for scraped in yaml.safe_load(config.read_text())["scrape_configs"][0]["static_configs"]:
            labels = {**scraped["labels"], "imerge_job": "train", "namespace": f"team-{index}"}
            static.append({**scraped, "labels": labels})
    merged["scrape_configs"][0]["static_configs"] = static
    path.write_text(yaml.safe_dump(merged))
    return [t for c in static for t in c["targets"]], sorted({c["labels"]["namespace"] for c in static})


@pytest.mark.timeout(400)
def test_prometheus_scrapes_two_jobs_of_one_name_in_two_namespaces_keeps_them_apart_and_every_expression_has_data(
        promtool, tmp_path):
    launches = [launch_job(tmp_path / f"job{i}") for i in range(2)]
    prometheus, stopped = None, []
    try:
        configs = [tmp_path / f"job{i}" / "prometheus.yml" for i in range(2)]
        for config in configs:
            wait_for("the launcher's prometheus.yml", config.exists, 60)
        config = configs[0]
        targets, namespaces = merged_config(configs, tmp_path / "prometheus.yml")
        assert len(targets) == 10 and len(namespaces) == 2  # per job: coordinator, 2 shards, 2 workers

        def all_up() -> bool:
            try:
                return all(scrape(t, 2) for t in targets)
            except OSError:
                return False

        wait_for("every role's /metrics", all_up, 120)
        for target in targets[:5]:  # promtool check metrics is clean on each endpoint's output
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as reply:
                exposition = reply.read()
            lint = subprocess.run([promtool["promtool"], "check", "metrics"], input=exposition,
                                  capture_output=True, timeout=30)
            assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), \
                f"{target}: {lint.stdout.decode()} {lint.stderr.decode()}"
            shadowed = {label for (_, labels) in scrape(target, 5) for label, _ in labels} & TARGET_LABELS
            assert not shadowed, f"{target}: metric labels a scrape configuration sets as target labels: {shadowed}"
        port = free_port()
        prometheus = subprocess.Popen([promtool["prometheus"], f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def targets_up() -> bool:
            try:
                return len(query(port, "up == 1")) == len(targets)
            except OSError:  # Prometheus still starting
                assert prometheus.poll() is None, prometheus.stderr.read().decode()[-2000:]
                return False

        wait_for("Prometheus to start and see every target up", targets_up, 60)
        top = subprocess.run(IMERGE + ["top", "--prometheus-config", str(config), "--once", "--interval-s", "1"],
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        assert "shards" in top.stdout and "workers" in top.stdout and "plan v" in top.stdout
        rows = [line for line in top.stdout.splitlines() if line.startswith("│")]
        assert len(rows) >= 4, top.stdout  # 2 shard rows and 2 worker rows

        deadline = time.monotonic() + 120
        for namespace in namespaces:  # every dashboard query, the variables set to one namespace, has its data only
            while missing := [e for e in expressions(namespace, "train") if not query(port, e)]:
                assert time.monotonic() < deadline, f"no data after 120s in namespace {namespace}: {missing}"
                time.sleep(2)
            for expr in dashboard_queries(namespace, "train"):
                seen = {series["metric"].get("namespace", namespace) for series in query(port, expr)}
                assert seen == {namespace}, (expr, seen)
        for expr in dashboard_queries(".*", "train"):  # the variable at All: the namespaces side by side, never summed
            series = query(port, expr)
            assert {s["metric"].get("namespace") for s in series} == set(namespaces), (expr, series)
        for rule in [r["record"] for r in recording_rules()]:
            pairs = {(s["metric"]["imerge_job"], s["metric"]["namespace"])
                     for s in query(port, f"count by (imerge_job, namespace) ({rule})")}
            assert pairs == {("train", n) for n in namespaces}, (rule, pairs)  # never the two jobs added together
        assert not query(port, f'ALERTS{{alertname=~"{AVAILABILITY}"}}')  # two healthy jobs: none even pending
        assert all(launch.poll() is None for launch in launches), "a job ended before the check"
        see_alerts_when_members_stop(port, tmp_path / "job0" / "roles.json", stopped)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
        for launch in launches:
            if launch.poll() is None:
                launch.send_signal(signal.SIGINT)
        for launch in launches:
            launch.wait(60)
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)


def test_a_metrics_server_serves_until_closed_and_closes_at_once():
    """close() returns without waiting out the serving loop's half-second poll (every role's close and every
    worker's model.close() paid it: up to 0.5 s each), and the port serves nothing afterwards."""
    from prometheus_client import CollectorRegistry

    from imerge.telemetry.metrics import MetricsServer

    for _ in range(3):  # the poll waited 0 to 0.5 s: three closes all under 0.2 s would be luck (1 in 16)
        server = MetricsServer(CollectorRegistry(), 0, "test")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
            assert reply.status == 200
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 0.2
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)
        server.close()  # twice: nothing more to do
