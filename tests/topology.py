"""Run a deployment's topology for real: one testbed network namespace per service or pod.

A deployment (the compose file, or the manifests the Helm chart renders) is
turned into :class:`Host` entries: the argv and environment of its container,
the health check that gates its dependents, and whether it is a job that must
finish. Hosts start in dependency order; each waits for what it depends on to
be healthy, by running that host's own health check inside its namespace.
Host names are the deployment's names (compose service names, Kubernetes DNS
names), so the addresses in the environment resolve unchanged.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time

from imerge.ops.redis_server import find_redis_server
from imerge.bench.testbed import LinkSpec, Testbed

IMERGE = [sys.executable, "-m", "imerge"]


@dataclasses.dataclass
class Host:
    name: str
    argv: list[str]
    env: dict[str, str]
    health: list[str] | None = None     # exits 0 once the host is healthy
    after: tuple[str, ...] = ()         # hosts that must be healthy first
    job: bool = False                    # must exit 0 for the deployment to have completed


def container_env(env: dict[str, str], data_dir: str) -> dict[str, str]:
    """A container's environment on this machine: its volumes (the shards' checkpoints) under ``data_dir``."""
    env = {**env}
    if "IMERGE_CHECKPOINT_DIR" in env:
        env["IMERGE_CHECKPOINT_DIR"] = f"{data_dir}/checkpoints"
    return env


def container_argv(command: list[str], data_dir: str) -> list[str]:
    """The argv that runs a container's command on this machine (imerge roles, redis-server)."""
    if command and command[0] == "imerge":
        return IMERGE + command[1:]
    if command and command[0] == "redis-server":
        argv = [find_redis_server(), *command[1:]]
        if "--dir" in argv:
            argv[argv.index("--dir") + 1] = data_dir
        return argv
    if command and command[0] == "redis-cli" and command[-1] == "ping":  # REDISCLI_AUTH: the password, as redis-cli
        return [sys.executable, "-c", "import os; from imerge.control.store import Store; "
                "auth = os.environ.get('REDISCLI_AUTH'); "
                "Store(f'redis://:{auth}@127.0.0.1:6379/0' if auth else 'redis://127.0.0.1:6379/0', 'probe').ping()"]
    return IMERGE + command  # the image's entrypoint is imerge


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a value, from the variables defined before it."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def run_topology(hosts: list[Host], timeout_s: float = 240.0) -> dict[str, str]:
    """Start every host in dependency order and wait for the jobs to exit 0; return each host's log."""
    logs: dict[str, list[str]] = {h.name: [] for h in hosts}

    def sink(line: str) -> None:
        name = line[1:line.index("]")]
        logs.setdefault(name, []).append(line)

    deadline = time.monotonic() + timeout_s
    with Testbed({h.name: LinkSpec() for h in hosts}, log_sink=sink) as bed:
        processes = {}
        for host in ordered(hosts):
            for dependency in host.after:
                wait_healthy(bed, by_name(hosts, dependency), deadline, logs)
            processes[host.name] = bed.spawn(host.name, host.argv, env=host.env)
        for host in hosts:
            if host.job:
                remaining = max(1.0, deadline - time.monotonic())
                try:
                    code = processes[host.name].wait(remaining)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{host.name} did not finish in {timeout_s:g}s:\n" + tail(logs)) from None
                assert code == 0, f"{host.name} exited with {code}:\n" + tail(logs)
    return {name: "\n".join(lines) for name, lines in logs.items()}


def by_name(hosts: list[Host], name: str) -> Host:
    return next(h for h in hosts if h.name == name)


def ordered(hosts: list[Host]) -> list[Host]:
    done: list[Host] = []
    while len(done) < len(hosts):
        ready = [h for h in hosts if h not in done and all(d in [x.name for x in done] for d in h.after)]
        assert ready, f"dependency cycle among {[h.name for h in hosts if h not in done]}"
        done += ready
    return done


def wait_healthy(bed: Testbed, host: Host, deadline: float, logs: dict[str, list[str]]) -> None:
    if host.health is None:
        return
    while True:
        result = subprocess.run(bed.exec_prefix(host.name) + host.health, env=host.env, capture_output=True,
                                text=True, timeout=30)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{host.name} never became healthy: {result.stderr[-500:]}\n" + tail(logs))
        time.sleep(0.5)


def tail(logs: dict[str, list[str]], lines: int = 8) -> str:
    return "\n".join(line for entries in logs.values() for line in entries[-lines:])
