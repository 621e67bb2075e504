"""A cluster emulated on one machine: one network namespace per host behind a switch.

Each host gets a namespace with a veth link into a switch namespace holding a
bridge. Both directions of every link are shaped with ``tc tbf`` (rate, burst,
queue limit); GSO is capped at the MTU so the shaper sees wire-sized packets,
as a real port does. Hosts reach each other by name through per-namespace
hosts files (``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over
``/etc/hosts``), so the addresses and environment of the compose file work
unchanged.

Everything is torn down on success, failure and Ctrl-C. A run killed with
SIGKILL leaves a marker naming its owner pid under ``/run/imerge-testbed``;
the next testbed (or ``imerge testbed cleanup``) removes what a dead owner left.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from imerge.ops import proc
from imerge.core.errors import IMergeError
from imerge.core.strategies import SHALLOW, TCP_CONGESTION
from imerge.telemetry.metrics import parse_net_dev

log = logging.getLogger(__name__)
MARKERS = Path("/run/imerge-testbed")
NETNS_ETC = Path("/etc/netns")
MTU = 1500  # Ethernet; 9000 for jumbo frames, as GPU cluster fabrics commonly run


class TestbedError(IMergeError):
    """The testbed cannot be set up here; nothing was left behind."""

    __test__ = False  # not a pytest test class


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One host's link: ``tc tbf`` rate, burst and queue limit, the same in both directions
    unless ``ingress_limit_kb`` sets the queue of the switch port toward the host."""

    rate_mbit: float = 1000.0
    burst_kb: float = 64.0
    limit_kb: float = 1024.0
    ingress_limit_kb: float = 0.0  # 0: same as limit_kb

    def tbf(self, limit_kb: float) -> list[str]:
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", f"{self.burst_kb:g}kb",
                "limit", f"{limit_kb:g}kb"]




@dataclasses.dataclass
class HostCounters:
    rx_bytes: int
    tx_bytes: int
    tcp_out_segs: int
    tcp_retrans_segs: int


def _run(argv: Sequence[str], what: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(f"{what} failed: {' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _set_sysctl(ns: str, key: str, value: str, host: str) -> None:
    """Write one of a namespace's own sysctls (a new namespace otherwise takes some of them from the host)."""
    _run(["ip", "netns", "exec", ns, sys.executable, "-c",
          f"with open('/proc/sys/{key}', 'w') as f: f.write({value!r})"], f"setting {key} = {value} for {host}")


def preflight(subnet: ipaddress.IPv4Network, tcp_congestion: str = TCP_CONGESTION) -> None:
    """Clear errors before anything is created."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (it creates network namespaces and tc qdiscs)")
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    if tcp_congestion not in available:
        raise TestbedError(f"TCP congestion control {tcp_congestion!r} is not available on this kernel "
                           f"(available: {' '.join(available)})")
    allowed_path = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    allowed = allowed_path.read_text().split()
    if tcp_congestion not in allowed:  # a namespace other than the host's may only pick an allowed one
        try:
            allowed_path.write_text(" ".join(allowed + [tcp_congestion]))
        except OSError as exc:
            raise TestbedError(f"TCP congestion control {tcp_congestion!r} is not in the host's allowed list "
                               f"({' '.join(allowed)}) and could not be added: {exc}") from None
        log.warning("added %s to the host's allowed TCP congestion controls (%s) so the testbed's hosts can use it",
                    tcp_congestion, " ".join(allowed))
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the testbed needs '{tool}' (Debian package iproute2) on PATH")
    for line in _run(["ip", "-o", "-4", "addr", "show"], "listing addresses").splitlines():
        address = ipaddress.IPv4Interface(line.split()[3])
        if address.network.overlaps(subnet) and not address.ip.is_loopback:
            raise TestbedError(f"address range {subnet} is in use on this machine ({line.split()[1]} has "
                               f"{address}); choose another with --subnet")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespaces(namespaces: Sequence[str]) -> None:
    existing = set(_run(["ip", "netns", "list"], "listing namespaces").split())
    for ns in namespaces:
        if ns in existing:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def reap_stale() -> list[str]:
    """Remove what testbeds whose owner died left behind; return the namespaces removed."""
    removed: list[str] = []
    if not MARKERS.is_dir():
        return removed
    for marker in MARKERS.glob("*.json"):
        try:
            record = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not _alive(record["pid"]):
            _delete_namespaces(record["namespaces"])
            removed += record["namespaces"]
            marker.unlink(missing_ok=True)
    return removed


class Testbed:
    """Hosts in namespaces behind one switch. Use as a context manager."""

    __test__ = False

    def __init__(self, links: dict[str, LinkSpec], subnet: str = "10.213.0.0/24",
                 log_sink: Callable[[str], None] | None = None, mtu: int = MTU,
                 tcp_congestion: str = TCP_CONGESTION):
        if not links:
            raise TestbedError("a testbed needs at least one host")
        if not 576 <= mtu <= 65000:
            raise TestbedError(f"MTU {mtu} is outside 576..65000")
        self.mtu = mtu
        self.tcp_congestion = tcp_congestion
        self.subnet = ipaddress.IPv4Network(subnet)
        if len(links) > self.subnet.num_addresses - 2:
            raise TestbedError(f"{len(links)} hosts do not fit in {subnet}")
        self.links = dict(links)
        self.tag = uuid.uuid4().hex[:5]
        self.switch = f"imtb{self.tag}-sw"
        self.namespace = {host: f"imtb{self.tag}-{i}" for i, host in enumerate(self.links)}
        hosts = list(self.subnet.hosts())
        self.address = {host: str(hosts[i]) for i, host in enumerate(self.links)}
        self.log_sink = log_sink or (lambda line: sys.stderr.write(line + "\n"))
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._threads: list[threading.Thread] = []
        self._marker = MARKERS / f"{self.tag}.json"
        self._up = False

    # -- setup and teardown ----------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        preflight(self.subnet, self.tcp_congestion)
        reap_stale()
        MARKERS.mkdir(parents=True, exist_ok=True)
        self._marker.write_text(json.dumps({"pid": os.getpid(),
                                            "namespaces": [self.switch, *self.namespace.values()]}))
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        self._up = True
        log.info("testbed %s up: %s", self.tag, ", ".join(f"{h}={a}" for h, a in self.address.items()))

    def _create(self) -> None:
        _run(["ip", "netns", "add", self.switch], "creating the switch namespace")
        _run(["ip", "-n", self.switch, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge"],
             "creating the bridge")
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "raising the bridge")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.address.items())
        for index, (host, link) in enumerate(self.links.items()):
            ns, port = self.namespace[host], f"v{self.tag}{index}"
            _run(["ip", "netns", "add", ns], f"creating namespace of {host}")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
            _run(["ip", "link", "add", port, "type", "veth", "peer", "name", port + "h"], f"creating {host}'s link")
            _run(["ip", "link", "set", port + "h", "netns", ns, "name", "eth0"], f"moving {host}'s link")
            _run(["ip", "link", "set", port, "netns", self.switch], f"plugging {host} into the switch")
            for target, dev in ((ns, "eth0"), (self.switch, port)):
                _run(["ip", "-n", target, "link", "set", dev, "gso_max_size", str(self.mtu + 14),
                      "mtu", str(self.mtu)],
                     f"setting up {host}'s link")
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"], f"bridging {host}")
            _run(["ip", "-n", ns, "addr", "add", f"{self.address[host]}/{self.subnet.prefixlen}", "dev", "eth0"],
                 f"addressing {host}")
            for dev in ("eth0", "lo"):
                _run(["ip", "-n", ns, "link", "set", dev, "up"], f"raising {host}'s {dev}")
            _set_sysctl(ns, "net/ipv4/tcp_congestion_control", self.tcp_congestion, host)
            _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *link.tbf(link.limit_kb)],
                 f"shaping {host}'s uplink")
            _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root",
                  *link.tbf(link.ingress_limit_kb or link.limit_kb)], f"shaping {host}'s downlink")

    def teardown(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                proc.signal_group(process, signal.SIGTERM)
        for _, process in self.processes:
            proc.stop(process, 5.0)
        for thread in self._threads:
            thread.join(5)
        _delete_namespaces([*self.namespace.values(), self.switch])
        self._marker.unlink(missing_ok=True)
        self._up = False

    # -- processes -----------------------------------------------------------------------
    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace[host]]

    def spawn(self, host: str, argv: Sequence[str], env: dict[str, str] | None = None,
              stream_logs: bool = True) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host``; its output goes to the log sink, each line prefixed with the host."""
        process = proc.spawn(self.exec_prefix(host) + list(argv), env=env,
                             stdout=subprocess.PIPE if stream_logs else subprocess.DEVNULL)
        self.processes.append((host, process))
        if stream_logs:
            thread = threading.Thread(target=self._stream, args=(host, process), daemon=True)
            thread.start()
            self._threads.append(thread)
        return process

    def _stream(self, host: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None, "spawned with its output piped"
        for raw in process.stdout:
            self.log_sink(f"[{host}] {raw.decode(errors='replace').rstrip()}")

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 60.0) -> str:
        """Run a short command on ``host`` and return its output."""
        result = subprocess.run(self.exec_prefix(host) + list(argv), capture_output=True, text=True,
                                timeout=timeout_s)
        if result.returncode != 0:
            raise TestbedError(f"{host}: {' '.join(argv)} failed: {result.stderr.strip()}")
        return result.stdout

    # -- kernel counters -----------------------------------------------------------------------
    def counters(self, host: str) -> HostCounters:
        text = self.run(host, ["cat", "/proc/net/dev", "/proc/net/snmp"])
        out_segs = retrans = 0
        tcp_lines = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
        rx, tx = parse_net_dev(text).get("eth0", (0, 0))
        if len(tcp_lines) == 2:
            tcp = dict(zip(tcp_lines[0][1:], tcp_lines[1][1:]))
            out_segs, retrans = int(tcp["OutSegs"]), int(tcp["RetransSegs"])
        return HostCounters(rx, tx, out_segs, retrans)


@dataclasses.dataclass(frozen=True)
class TestbedConfig:
    __test__ = False
    rate_mbit: float = dataclasses.field(default=1000.0, metadata={"help": "link rate of every host, Mbit/s",
                                                                    "choices": None, "aliases": ()})
    burst_kb: float = dataclasses.field(default=64.0, metadata={"help": "tbf burst of every link, kB",
                                                                 "choices": None, "aliases": ()})
    limit_kb: float = dataclasses.field(default=1024.0, metadata={"help": "tbf queue limit of every link, kB",
                                                                   "choices": None, "aliases": ()})
    shard_queue_kb: float = dataclasses.field(default=0.0, metadata={
        "help": f"queue of the switch port toward each shard, kB (0: --limit-kb; {SHALLOW:g}: shallow, "
                "reproduces incast loss)", "choices": None, "aliases": ()})
    mtu: int = dataclasses.field(default=MTU, metadata={
        "help": "MTU of every link (9000: jumbo frames, fewer packets for the kernel to move)",
        "choices": None, "aliases": ()})
    tcp_congestion: str = dataclasses.field(default=TCP_CONGESTION, metadata={
        "help": "TCP congestion control of every host (the kernel's tcp_available_congestion_control lists the "
                "choices)", "choices": None, "aliases": ()})
    subnet: str = dataclasses.field(default="10.213.0.0/24", metadata={"help": "address range of the hosts",
                                                                        "choices": None, "aliases": ()})
    cleanup: bool = dataclasses.field(default=False, metadata={
        "help": "only remove what killed testbed runs left behind, then exit", "choices": None, "aliases": ()})

    def __post_init__(self) -> None:
        from imerge.core.config import require

        require(self.rate_mbit > 0, "rate_mbit", "must be positive")
        require(self.burst_kb > 0 and self.limit_kb > 0, "limit_kb", "burst and limit must be positive")
        require(self.shard_queue_kb >= 0, "shard_queue_kb", "must be >= 0")
        require(576 <= self.mtu <= 65000, "mtu", "must be within 576..65000")
        require(self.burst_kb * 1000 >= self.mtu, "burst_kb", "must hold at least one packet of --mtu bytes")
        try:
            ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            require(False, "subnet", str(exc))

    def links(self, roles: Sequence[str]) -> dict[str, LinkSpec]:
        return {role: LinkSpec(self.rate_mbit, self.burst_kb, self.limit_kb,
                               self.shard_queue_kb if role.startswith("ps") else 0.0) for role in roles}


def start_redis(testbed: Testbed, host: str = "redis", timeout_s: float = 20.0) -> str:
    """A redis-server on ``host``; returns its URL once it answers from inside the testbed."""
    import time

    from imerge.ops.redis_server import find_redis_server

    testbed.spawn(host, [find_redis_server(), "--port", "6379", "--bind", "0.0.0.0", "--protected-mode", "no",
                         "--save", "", "--appendonly", "no"], stream_logs=False)
    url = f"redis://{host}:6379/0"
    probe = f"from imerge.control.store import Store; Store({url!r}, 'probe', socket_timeout_s=1).ping()"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            testbed.run(host, [sys.executable, "-c", probe], timeout_s=10)
            return url
        except (TestbedError, subprocess.TimeoutExpired):
            if time.monotonic() > deadline:
                raise TestbedError(f"redis-server on {host} did not answer within {timeout_s:g}s") from None
            time.sleep(0.2)


def job_roles(shards: int, workers: int) -> list[str]:
    return ["redis", "coordinator", *(f"ps{i}" for i in range(shards)), *(f"worker{r}" for r in range(workers))]
