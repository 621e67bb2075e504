"""``imerge wind-down`` (the chart's wind-down Job, without JobSet): once the job's Jobs finished, the shards' and
Redis' StatefulSets go to zero replicas. The Kubernetes API is a stand-in HTTP server here that answers the two
calls the command makes, as the API server's REST paths and JSON bodies have them (no cluster runs here)."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

IMERGE = [sys.executable, "-m", "imerge"]


class KubeApiStandIn(http.server.ThreadingHTTPServer):
    """Jobs that do not exist for the first 2 looks (Kueue has not admitted them, say), then run, and turn Complete
    (or Failed) after ``polls`` looks; every call is recorded."""

    def __init__(self, finished: str, polls: int):
        self.finished, self.polls, self.calls = finished, polls, []
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    server: KubeApiStandIn

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's
        self.server.calls.append(("GET", self.path, self.headers.get("Authorization"), None))
        if not self.path.startswith("/apis/batch/v1/namespaces/train/jobs/"):
            return self._reply(404, {"kind": "Status", "reason": "NotFound"})
        looks = sum(1 for call in self.server.calls if call[0] == "GET")
        if looks <= 2:
            return self._reply(404, {"kind": "Status", "reason": "NotFound"})
        conditions = [{"type": self.server.finished, "status": "True"}] if looks > self.server.polls else [
            {"type": "Suspended", "status": "False"}]
        self._reply(200, {"kind": "Job", "status": {"conditions": conditions}})

    def do_PATCH(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.calls.append(("PATCH", self.path, self.headers.get("Content-Type"), body))
        if "/statefulsets/" not in self.path:
            return self._reply(403, {"kind": "Status", "message": "forbidden"})
        self._reply(200, {"kind": "Scale", "spec": body["spec"]})

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def kube_api(request):
    finished, polls = request.param
    server = KubeApiStandIn(finished, polls)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def wind_down(server: KubeApiStandIn, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    token = tmp_path / "token"
    token.write_text("service-account-token\n")
    return subprocess.run(IMERGE + ["wind-down", "--jobs", "train-imerge-worker,train-imerge-coordinator",
                                    "--statefulsets", "train-imerge-ps,train-imerge-redis", "--namespace", "train",
                                    "--api-url", f"http://127.0.0.1:{server.server_address[1]}",
                                    "--token-file", str(token), "--interval-s", "0.05", *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kube_api", [("Complete", 5), ("Failed", 3)], indirect=True, ids=["complete", "failed"])
def test_the_shards_and_redis_are_scaled_to_zero_once_a_job_finished(kube_api, tmp_path):
    result = wind_down(kube_api, tmp_path)
    assert result.returncode == 0, result.stderr
    gets = [call for call in kube_api.calls if call[0] == "GET"]
    patches = [call for call in kube_api.calls if call[0] == "PATCH"]
    assert len(gets) > kube_api.polls and all(call[2] == "Bearer service-account-token" for call in gets)
    assert [call[1] for call in patches] == [f"/apis/apps/v1/namespaces/train/statefulsets/{name}/scale"
                                             for name in ("train-imerge-ps", "train-imerge-redis")]
    assert all(call[2] == "application/merge-patch+json" and call[3] == {"spec": {"replicas": 0}} for call in patches)
    assert kube_api.calls.index(patches[0]) > kube_api.polls  # not one scale before a Job finished
    assert f"{kube_api.finished}; scaled StatefulSet train-imerge-ps, train-imerge-redis to 0" in result.stderr


@pytest.mark.parametrize("kube_api", [("Complete", 10**6)], indirect=True)
def test_a_job_that_never_finishes_times_out_naming_what_it_waited_for_and_scales_nothing(kube_api, tmp_path):
    result = wind_down(kube_api, tmp_path, "--timeout-s", "0.5")
    assert result.returncode == 1 and not [call for call in kube_api.calls if call[0] == "PATCH"]
    assert "timed out after 0.5s waiting for one of the Jobs train-imerge-worker, train-imerge-coordinator to " \
           "finish; the StatefulSets are left running" in result.stderr


def test_no_api_and_no_names_are_one_line_errors(tmp_path):
    result = subprocess.run(IMERGE + ["wind-down", "--jobs", "a", "--statefulsets", "b", "--namespace", "x"],
                            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"})
    assert result.returncode == 1 and "no Kubernetes API: not in a pod" in result.stderr, result.stderr
    result = subprocess.run(IMERGE + ["wind-down", "--jobs", "a"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().endswith("--statefulsets: name at least one StatefulSet")
