"""What every role's Prometheus endpoint shares: serving, link capacity, interface counters, scrape config.

Each role keeps its metrics in a registry of its own (several shards may share a
process in tests) and serves it on its own port. Names follow the Prometheus
conventions: base units, ``_bytes``, ``_seconds``, ``_total``, and low-cardinality
labels (``shard``, ``worker``, ``group``, ``interface``).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Gauge, Info, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
PROC_NET_DEV = Path("/proc/net/dev")
# Buckets for the latencies of an iteration's parts: 1 ms .. 60 s.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SHARE = Path(__file__).resolve().parent / "share"  # the recording rules and dashboards, shipped with the package


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """Interface name -> (received bytes, transmitted bytes), from the text of ``/proc/net/dev``
    (other text around it, such as ``/proc/net/snmp``, is skipped)."""
    found = {}
    for line in text.splitlines():
        name, _, fields = line.partition(":")
        values = fields.split()
        if len(values) >= 9 and values[0].isdigit() and values[8].isdigit():
            found[name.strip()] = (int(values[0]), int(values[8]))
    return found


class InterfaceCollector(Collector):
    """The kernel's byte counters of every interface in this process's namespace or container."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        received = CounterMetricFamily("imerge_network_receive_bytes", "Bytes received by the interface "
                                       "(kernel counter of this namespace)", labels=["interface"])
        sent = CounterMetricFamily("imerge_network_transmit_bytes", "Bytes transmitted by the interface "
                                   "(kernel counter of this namespace)", labels=["interface"])
        try:
            interfaces = parse_net_dev(PROC_NET_DEV.read_text())
        except OSError:
            interfaces = {}
        for name, (rx, tx) in sorted(interfaces.items()):
            received.add_metric([name], rx)
            sent.add_metric([name], tx)
        yield received
        yield sent


def build_versions() -> dict[str, str]:
    """The versions of IMerge and torch installed (``imerge_build_info``'s labels), read without importing torch."""
    found = {}
    for label, package in (("version", "imerge"), ("torch_version", "torch")):
        try:
            found[label] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[label] = "unknown"
    return found


def role_registry(link_mbps: float) -> CollectorRegistry:
    """A fresh registry holding what every role exports: link capacity, interface counters, and the process's
    (CPU seconds, memory, open files: ``process_*``) and Python's (``python_info``) own figures."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge("imerge_link_capacity_bytes_per_second", "Configured capacity of this host's network link",
          registry=registry).set(link_mbps * 1e6 / 8)
    Info("imerge_build", "The IMerge release and the torch it runs on (value 1)",
         registry=registry).info(build_versions())
    registry.register(InterfaceCollector())
    return registry


def report_port(ports_file: str, name: str, port: int) -> None:
    """Add ``name: port`` to the JSON ``ports_file`` (atomically; nothing when the path is empty)."""
    if not ports_file:
        return
    path = Path(ports_file)
    try:
        ports = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        ports = {}
    ports[name] = port
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(ports))
        os.replace(temporary, path)
    except OSError as exc:
        from imerge.core.errors import ConfigError

        raise ConfigError("--ports-file", f"cannot write {path}: {exc.strerror or exc}") from None


class MetricsServer:
    """Serves one registry's /metrics on its own port; ``port`` -1 means off, 0 any free port (reported to
    ``ports_file`` once bound)."""

    def __init__(self, registry: CollectorRegistry, port: int, what: str, host: str = "127.0.0.1",
                 ports_file: str = ""):
        self.port = -1
        self._server: Any = None
        if port < 0:
            return
        try:
            self._server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            from imerge.core.errors import IMergeError

            raise IMergeError(f"{what}: cannot serve metrics on {host}:{port}: {exc}; "
                              "choose another with --metrics-port (-1: off) or --metrics-host") from exc
        self.port = self._server.server_port
        log.info("%s: metrics on http://%s:%d/metrics", what, host, self.port)
        report_port(ports_file, "metrics", self.port)

    def close(self) -> None:
        """Stop serving; returns at once (the serving loop looks for a shutdown only every half second, or when
        a connection comes: it is poked with empty connections until it has stopped)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        stopping = threading.Thread(target=server.shutdown, name="imerge-metrics-shutdown", daemon=True)
        stopping.start()
        host, port = server.server_address[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        deadline = time.monotonic() + 5
        while stopping.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
                pass
            stopping.join(0.01)
        stopping.join(5)
        server.server_close()


def rules_file() -> Path | None:
    """The recording rules that ship inside the package (``imerge/telemetry/share/rules.yml``, a copy of
    ``deploy/prometheus/rules.yml`` that ``python -m imerge.ops.deploygen`` keeps)."""
    path = SHARE / "rules.yml"
    return path if path.is_file() else None


def prometheus_config(targets: dict[str, str], job: str, rules: Path | None, interval_s: float = 1.0) -> str:
    """A Prometheus configuration (YAML) scraping ``targets`` (role -> host:port)."""
    config = {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "rule_files": [str(rules)] if rules else [],
        "scrape_configs": [{
            "job_name": "imerge",
            "static_configs": [{"targets": [address], "labels": {"role": role, "imerge_job": job}}
                               for role, address in targets.items()],
        }],
    }
    return yaml.safe_dump(config, sort_keys=False)
