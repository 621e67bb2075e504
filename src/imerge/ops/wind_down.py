"""``imerge wind-down``: a chart release without JobSet ends what its job leaves running.

The shards and Redis of a release are StatefulSets: nothing of Kubernetes stops them when the workers'
Job finishes, and they would hold their CPUs and memory until ``helm uninstall``. The chart's wind-down
Job runs this command: it waits until one of the release's Jobs (the workers', the coordinator's) has
finished, Complete or Failed, then scales the shards' and Redis' StatefulSets to zero replicas. Their
PersistentVolumeClaims (the shards' checkpoints) stay. It talks to the Kubernetes API with the pod's
service account (the chart's Role allows only reading those Jobs and scaling those StatefulSets).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from imerge.core.config import option, require
from imerge.core.errors import IMergeError, WaitTimeout

log = logging.getLogger(__name__)
ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FINISHED = ("Complete", "Failed")


def _in_cluster_api() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else (f"https://{host}:{port}" if host else "")


@dataclasses.dataclass(frozen=True)
class WindDownConfig:
    jobs: str = option("", "the Jobs to wait for, comma-separated: once one of them finished (Complete or "
                           "Failed), the StatefulSets are scaled to zero")
    statefulsets: str = option("", "the StatefulSets to scale to zero replicas, comma-separated")
    namespace: str = option("", "their namespace (default: the pod's own)")
    api_url: str = option("", "the Kubernetes API (default: the in-cluster one, from KUBERNETES_SERVICE_HOST)")
    token_file: str = option(str(ACCOUNT / "token"), "the service account's token")
    ca_file: str = option(str(ACCOUNT / "ca.crt"), "the CA that signs the API server's certificate")
    interval_s: float = option(15.0, "seconds between two looks at the Jobs")
    timeout_s: float = option(7 * 86400.0, "longest wait for a Job to finish, seconds (then the StatefulSets are "
                                           "left as they are, and the command fails)")

    def __post_init__(self) -> None:
        require(bool(self.names("jobs")), "jobs", "name at least one Job")
        require(bool(self.names("statefulsets")), "statefulsets", "name at least one StatefulSet")
        require(self.interval_s > 0, "interval_s", "must be positive")
        require(self.timeout_s > 0, "timeout_s", "must be positive")

    def names(self, field: str) -> list[str]:
        return [name.strip() for name in str(getattr(self, field)).split(",") if name.strip()]


class KubeApi:
    """The few calls wind-down makes, as JSON over HTTPS with a bearer token."""

    def __init__(self, config: WindDownConfig):
        self.url = (config.api_url or _in_cluster_api()).rstrip("/")
        if not self.url:
            raise IMergeError("no Kubernetes API: not in a pod (KUBERNETES_SERVICE_HOST unset) and no --api-url")
        self.namespace = config.namespace or self._read(ACCOUNT / "namespace", "namespace")
        self.token = self._read(Path(config.token_file), "token") if Path(config.token_file).is_file() else ""
        self.context = ssl.create_default_context(cafile=config.ca_file) if self.url.startswith("https") else None

    @staticmethod
    def _read(path: Path, what: str) -> str:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise IMergeError(f"cannot read the service account's {what} ({path}): {exc.strerror}") from None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             content_type: str = "application/json", missing: dict[str, Any] | None = None) -> dict[str, Any]:
        """The reply's JSON; ``missing``, where given, when the object does not exist (404)."""
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Accept": "application/json", "Content-Type": content_type,
                                                  **({"Authorization": f"Bearer {self.token}"} if self.token else {})})
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as reply:
                return dict(json.loads(reply.read() or b"{}"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and missing is not None:
                return missing
            detail = exc.read().decode(errors="replace")[:300]
            raise IMergeError(f"Kubernetes API: {method} {path}: {exc.code} {exc.reason}: {detail}") from None
        except (OSError, ValueError) as exc:
            raise IMergeError(f"Kubernetes API {self.url}: {method} {path}: {exc}") from None

    def job_state(self, name: str) -> str:
        """Complete, Failed, or "" while the Job runs (or does not exist yet)."""
        job = self.call("GET", f"/apis/batch/v1/namespaces/{self.namespace}/jobs/{name}", missing={})
        true = {c.get("type") for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"}
        return next((state for state in FINISHED if state in true), "")

    def scale_to_zero(self, statefulset: str) -> None:
        self.call("PATCH", f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{statefulset}/scale",
                  {"spec": {"replicas": 0}}, content_type="application/merge-patch+json")


def run_wind_down(config: WindDownConfig) -> str:
    api = KubeApi(config)
    jobs, deadline = config.names("jobs"), time.monotonic() + config.timeout_s
    log.info("waiting for one of the Jobs %s to finish", ", ".join(jobs))
    while True:
        finished = [(name, state) for name in jobs if (state := api.job_state(name))]
        if finished:
            break
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {config.timeout_s:g}s waiting for one of the Jobs {', '.join(jobs)} "
                              "to finish; the StatefulSets are left running")
        time.sleep(config.interval_s)
    name, state = finished[0]
    for statefulset in config.names("statefulsets"):
        api.scale_to_zero(statefulset)
    return (f"Job {name}: {state}; scaled StatefulSet {', '.join(config.names('statefulsets'))} to 0 replicas "
            "(their volumes are kept)")
