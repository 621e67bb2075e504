"""The network testbed: shaped links, names, counters, and a teardown that leaves nothing."""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from imerge.bench.testbed import MARKERS, LinkSpec, Testbed, TestbedError

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="the testbed needs root and iproute2")
IMERGE = [sys.executable, "-m", "imerge"]
RECEIVER = """
import socket, time
server = socket.socket(); server.bind(("0.0.0.0", 5001)); server.listen(1)
conn, _ = server.accept(); total, start = 0, None
while data := conn.recv(1 << 20):
    start = start or time.monotonic(); total += len(data)
print(total * 8 / (time.monotonic() - start) / 1e6)
"""
SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], 5001)); chunk = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])): conn.sendall(chunk)
"""


def leftovers() -> list[str]:
    """Namespaces, root-namespace links, hosts folders and markers a testbed could leave."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    found = [n for n in namespaces if n.startswith("imtb")]
    found += [line.split(":")[1].strip() for line in links if re.match(r"v[0-9a-f]{5}\d+h?(@|$)",
                                                                        line.split(":")[1].strip())]
    found += [str(p) for p in Path("/etc/netns").glob("imtb*")] + [str(p) for p in MARKERS.glob("*.json")]
    return found


@pytest.mark.parametrize("rate,mtu", [(50, 1500), (200, 9000)])
def test_a_shaped_link_delivers_its_configured_rate(rate, mtu):
    lines: list[str] = []
    with Testbed({"a": LinkSpec(rate_mbit=rate), "b": LinkSpec(rate_mbit=rate)}, log_sink=lines.append,
                 mtu=mtu) as bed:
        assert f"mtu {mtu} " in bed.run("b", ["ip", "link", "show", "eth0"])
        receiver = bed.spawn("a", [sys.executable, "-c", RECEIVER])
        time.sleep(0.5)
        megabytes = max(4, rate // 8)  # about a second of traffic
        bed.run("b", [sys.executable, "-c", SENDER, "a", str(megabytes)])
        receiver.wait(30)
        time.sleep(0.2)  # let the output thread catch up
        measured = float(lines[-1].split()[-1])
        assert lines[-1].startswith("[a] ")
        assert abs(measured - rate) <= 0.10 * rate, f"{measured:.1f} Mbit/s on a {rate} Mbit/s link"
        counters = bed.counters("a")
        assert counters.rx_bytes >= megabytes << 20
        assert bed.counters("b").tcp_out_segs > 0


def test_bad_mtu_is_refused_before_anything_is_created():
    with pytest.raises(TestbedError, match="MTU 70000"):
        Testbed({"a": LinkSpec()}, mtu=70000)
    from imerge.core.config import ConfigError
    from imerge.bench.testbed import TestbedConfig

    with pytest.raises(ConfigError, match="burst"):
        TestbedConfig(burst_kb=4, mtu=9000)


def test_hosts_reach_each_other_by_name():
    with Testbed({"redis": LinkSpec(), "ps0": LinkSpec(), "worker0": LinkSpec()}) as bed:
        resolved = bed.run("worker0", [sys.executable, "-c",
                                       "import socket; print(socket.gethostbyname('ps0'), "
                                       "socket.gethostbyname('redis'))"]).split()
        assert resolved == [bed.address["ps0"], bed.address["redis"]]
        congestion = bed.run("worker0", ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]).strip()
        assert congestion == "cubic"  # pinned, whatever the host runs
    assert leftovers() == []


def test_setup_failure_leaves_nothing_and_says_why():
    with pytest.raises(TestbedError, match="do not fit"):
        Testbed({f"h{i}": LinkSpec() for i in range(10)}, subnet="10.213.0.0/29")
    with pytest.raises(TestbedError, match="failed"):
        with Testbed({"a": LinkSpec(), "b": LinkSpec(rate_mbit=0)}):  # tc refuses b's link, after a is up
            pass
    assert leftovers() == []


def test_address_range_in_use_is_refused():
    used = [ipaddress.IPv4Interface(line.split()[3]) for line in
            subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout.splitlines()]
    used = [a for a in used if not a.ip.is_loopback]
    if not used:
        pytest.skip("this machine has no non-loopback address to collide with")
    with pytest.raises(TestbedError, match=f"address range {used[0].network} is in use"):
        Testbed({"a": LinkSpec()}, subnet=str(used[0].network)).setup()
    assert leftovers() == []


def test_not_root_gets_a_clear_message():
    probe = ("from imerge.bench.testbed import Testbed, LinkSpec, TestbedError\n"
             "try:\n    Testbed({'a': LinkSpec()}).setup()\nexcept TestbedError as exc:\n    print(exc)")
    result = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                             "-c", probe], capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": "/tmp"})
    assert "the testbed needs root" in result.stdout, result.stderr


def start_job(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(IMERGE + ["testbed", "--shards", "1", "--workers", "2", "--model", "digits-cnn",
                                      "--iters", "1000000", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_training(run: subprocess.Popen, tmp_path: Path) -> None:
    deadline = time.monotonic() + 180
    log = tmp_path / "worker1.log"
    while not (log.exists() and "iteration=3 " in log.read_text()):
        assert run.poll() is None, run.stdout.read()
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_run_killed_midway_leaves_nothing(tmp_path, sig):
    run = start_job(tmp_path)
    wait_for_training(run, tmp_path)
    namespaces = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout.split() if n.startswith("imtb")]
    assert len(namespaces) == 6  # switch, redis, coordinator, ps0, worker0, worker1
    scrape = yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    assert sorted(t for c in scrape for t in c["targets"]) == \
        ["coordinator:9400", "ps0:9400", "worker0:9400", "worker1:9400"]
    worker0 = next(n for n in namespaces if n.endswith("-3"))  # hosts: redis, coordinator, ps0, worker0, ...
    exposition = subprocess.run(["ip", "netns", "exec", worker0, sys.executable, "-c",
                                 "import urllib.request; print(urllib.request.urlopen("
                                 "'http://worker0:9400/metrics', timeout=10).read().decode())"],
                                capture_output=True, text=True, timeout=60).stdout
    assert "imerge_link_capacity_bytes_per_second 1.25e+08" in exposition  # the shaped 1000 Mbit/s
    pids = {pid for ns in namespaces for pid in
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()}
    assert len(pids) >= 5
    run.send_signal(sig)
    run.communicate(timeout=60)
    if sig == signal.SIGKILL:  # nothing could clean up: the children die with their parent, and the
        time.sleep(1.0)        # namespaces are reaped by the next testbed or by --cleanup
        cleanup = subprocess.run(IMERGE + ["testbed", "--cleanup"], capture_output=True, text=True, timeout=60)
        assert cleanup.returncode == 0 and "removed 6 namespaces" in cleanup.stdout
    else:
        assert run.returncode == 128 + signal.SIGINT
    assert leftovers() == []
    deadline = time.monotonic() + 10  # a killed process in the middle of an fsync dies once the write returns
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], [Path(f"/proc/{pid}/stat").read_text() for pid in alive if Path(f"/proc/{pid}").exists()]


def _metric(exposition: str, name: str) -> float:
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", exposition, re.MULTILINE)
    assert found, f"{name} is not in the shard's metrics"
    return float(found.group(1))


def test_the_shard_serves_a_rounds_pulls_in_the_order_they_were_asked(tmp_path):
    """On a 50 Mbit/s link a round's two pulls want the shard's uplink at once: the pull asked second waits
    while the first one's blocks are queued on the shard's host (--pull-order auto, the default: arrival where
    one shard holds the job's blocks)."""
    run = subprocess.Popen(IMERGE + ["testbed", "--shards", "1", "--workers", "2", "--model", "digits-cnn",
                                     "--rate-mbit", "50", "--iters", "1000000", "--log-dir", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, log = time.monotonic() + 180, tmp_path / "worker1.log"
        while not (log.exists() and "iteration=30 " in log.read_text()):
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "the job never trained 30 iterations"
            time.sleep(0.5)
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        worker0 = next(n for n in namespaces if n.startswith("imtb") and n.endswith("-3"))
        exposition = subprocess.run(["ip", "netns", "exec", worker0, sys.executable, "-c",
                                     "import urllib.request; print(urllib.request.urlopen("
                                     "'http://ps0:9400/metrics', timeout=10).read().decode())"],
                                    capture_output=True, text=True, timeout=60).stdout
        waits = _metric(exposition, "imerge_shard_pull_turn_waits_total")
        waited_s = _metric(exposition, "imerge_shard_pull_turn_wait_seconds_total")
        pulled = _metric(exposition, "imerge_shard_pulls_total")
        assert waits > 10 and 0 < waited_s <= waits * 0.06, (waits, waited_s, pulled)
    finally:
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    assert leftovers() == []
