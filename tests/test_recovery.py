"""Recovery of whole jobs (`imerge launch`, real processes): kill -9, SIGSTOP, SIGTERM, restarts exhausted.

With T = 1 a job that loses a shard or a worker resumes from the last checkpoint every shard holds and
ends with parameters equal, bit for bit, to a fault-free run of the same steps. One job takes five faults in
turn (kill -9 of a shard, kill -9 of a worker, SIGSTOP of a shard, SIGTERM of a shard, kill -9 of the
coordinator), which keeps the suite short; each step waits for the previous recovery and for progress after it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file

from flood import Flood
from imerge.wire.datapath import Kind, read_header, send_frame
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

from imerge.ps.checkpoint import CheckpointStore
from imerge.ops.redis_server import RedisServer

ITERS = 200
EVERY = 4
JOB = ["--shards", "2", "--workers", "2", "--model", "digits-cnn", "--data", "digits", "--no-evaluate"]


class Run:
    """One `imerge launch` of the test job in ``folder``: checkpoints every 4 rounds, heartbeats of 3 s."""

    def __init__(self, folder: Path, *args: str, command: str = "launch", iters: int = ITERS, **env_vars: str):
        self.folder = folder
        self.logs = folder / "logs"
        self.model = folder / "model.safetensors"
        self.summary = folder / "summary.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
        env.update(IMERGE_CHECKPOINT_EVERY=str(EVERY), IMERGE_HEARTBEAT_TTL_S="3", **env_vars)
        self.process = subprocess.Popen([sys.executable, "-m", "imerge", command, "--log-dir", str(self.logs),
                                         "--save", str(self.model), "--summary-json", str(self.summary), *JOB,
                                         "--iters", str(iters), *args],
                                        env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def _until(self, done, what: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not (result := done()):
            assert self.process.poll() is None, f"the job ended before {what}: {self.finish()[1]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
            time.sleep(0.02)
        return result

    def wait_round(self, shard: int, round_: int, timeout_s: float = 120) -> None:
        """Until shard ``shard`` holds a complete checkpoint of ``round_`` or later."""
        store = CheckpointStore(self.logs / "checkpoints", shard)
        self._until(lambda: max(store.rounds(), default=-1) >= round_, f"checkpoint of round {round_}", timeout_s)

    def wait_generation_started(self, generation: int, timeout_s: float = 60) -> float:
        """When (epoch seconds, from its log) the coordinator started ``generation``."""
        return self._until(lambda: next((log_time(line) for line in self.log("coordinator").splitlines()
                                         if f"starting generation {generation} " in line), None),
                           f"generation {generation}", timeout_s)

    def wait_recovered(self, generation: int, timeout_s: float = 90) -> int:
        """Until both workers rejoined ``generation`` (or a later one); returns the round worker 0 resumed at."""
        pattern = re.compile(r"rejoined job \S+ in generation (\d+) at iteration (\d+)")

        def rejoined():
            latest = [pattern.findall(self.log(worker))[-1:] for worker in ("worker0", "worker1")]
            return latest if all(found and int(found[0][0]) >= generation for found in latest) else None

        return int(self._until(rejoined, f"rejoin in generation {generation}", timeout_s)[0][0][1])

    def pid(self, role: str) -> int:
        return json.loads((self.logs / "roles.json").read_text())[role]

    def signal(self, role: str, signum: int) -> float:
        os.kill(self.pid(role), signum)
        return time.time()

    def finish(self, timeout_s: float = 200) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, output

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text(errors="replace")


def same_parameters(a: Path, b: Path) -> bool:
    first, second = load_file(str(a)), load_file(str(b))
    return first.keys() == second.keys() and all(bool((first[k] == second[k]).all()) for k in first)


def log_time(line: str) -> float:
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    return time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000


class Reference:
    """The fault-free run, started at once and waited for where its result is first compared: it runs while
    the first test's job waits out its faults."""

    def __init__(self, folder: Path):
        self.run = Run(folder)
        self.done = False

    @property
    def model(self) -> Path:
        if not self.done:
            code, output = self.run.finish()
            assert code == 0, output
            self.done = True
        return self.run.model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    reference = Reference(tmp_path_factory.mktemp("reference"))
    yield reference
    if reference.run.process.poll() is None:
        reference.run.process.kill()
        reference.run.process.communicate()


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    os.kill(server.process.pid, signal.SIGCONT)
    server.stop()


@pytest.mark.timeout(360)
def test_kill_9_of_a_shard_and_a_worker_sigstop_and_sigterm_each_recover_bit_exact(tmp_path, reference, redis_server):
    """One job, six faults in turn, each after the previous recovery made progress; the last, Redis frozen
    (SIGSTOP) for 10 s, is no fault of any member: every heartbeat key expires meanwhile, but once Redis answers
    again the coordinator gives every member a heartbeat TTL to renew before it judges any, so nothing rolls
    back."""
    run = Run(tmp_path, "--redis-url", redis_server.url)
    run.wait_round(1, 20)
    run.signal("ps1", signal.SIGKILL)  # 1: a shard dies mid-round
    resumed = run.wait_recovered(1)
    assert "restored from round" in run.log("ps1")

    run.wait_round(1, resumed + 12)
    run.signal("worker0", signal.SIGKILL)  # 2: a worker dies (worker 0: the one that reports progress)
    resumed = run.wait_recovered(2)
    assert "worker 0/2 rejoined" in run.log("worker0")

    run.wait_round(0, resumed + 12)
    stopped = run.signal("ps0", signal.SIGSTOP)  # 3: a shard freezes
    detected = run.wait_generation_started(3, timeout_s=15)
    run.signal("ps0", signal.SIGCONT)
    assert detected - stopped < 5.0, f"a frozen shard was detected after {detected - stopped:.1f}s"
    resumed = run.wait_recovered(3)

    run.wait_round(1, resumed + 12)
    run.signal("ps1", signal.SIGTERM)  # 4: a shard is preempted
    resumed = run.wait_recovered(4)
    ps1 = run.log("ps1")
    assert "stopping: draining until a final checkpoint" in ps1
    assert re.search(r"shard 1: final checkpoint at round \d+", ps1), ps1  # written before it exited

    run.wait_round(1, resumed + 8)
    run.signal("coordinator", signal.SIGKILL)  # 5: the coordinator dies; training goes on, it is restarted
    run._until(lambda: "restarted: job" in run.log("coordinator"), "the coordinator's restart", 60)
    assert re.search(r"is at generation 4 with plan v\d; watching on", run.log("coordinator"))  # v2: --tune switched

    run.wait_round(1, resumed + 16)
    os.kill(redis_server.process.pid, signal.SIGSTOP)  # 6: Redis freezes
    time.sleep(10)
    assert run.process.poll() is None, "the job ended before Redis was frozen"
    os.kill(redis_server.process.pid, signal.SIGCONT)

    code, output = run.finish()
    assert code == 0, output
    text = " ".join(output.split())
    assert "ps1 exited with code -9 (restart 1 of 2)" in text
    assert "worker0 exited with code -9 (restart 1 of 2)" in text
    assert "ps1 exited with code 0 (restart 2 of 2)" in text  # the preempted shard exited cleanly in its grace
    assert "coordinator exited with code -9 (restart 1 of 2)" in text
    assert "starting generation 5" not in run.log("coordinator")  # one recovery per fault
    assert same_parameters(run.model, reference.model)
    summary = json.loads(run.summary.read_text())  # the restarted worker 0 kept reporting progress
    expected = json.loads(reference.run.summary.read_text())
    assert summary["iterations"] == expected["iterations"] == ITERS and summary["restarts"] >= 4, summary
    assert summary["final_loss"] == expected["final_loss"], (summary, expected)


@pytest.mark.timeout(240)
def test_redis_killed_and_restarted_empty_fails_fast_with_the_reason(tmp_path):
    redis = RedisServer()
    try:
        run = Run(tmp_path, "--redis-url", redis.url, iters=5000)
        run.wait_round(1, 8)
        redis.process.kill()
        redis.process.wait(10)
        killed = time.monotonic()
        redis = RedisServer(port=redis.port)  # the same address, without the job's keys
        restarted_s = time.monotonic() - killed
        code, output = run.finish()
        assert code == 1
        text = " ".join(output.split())
        if "Connection refused" in text:
            # the new server (up restarted_s after the kill) came too late for a role whose retries (redis-py's
            # jittered backoff, 10 tries) had run out, as on a loaded machine: it fails fast, naming Redis
            assert f"Error 111 connecting to 127.0.0.1:{redis.port}" in text and "the job cannot go on" in text, \
                (restarted_s, text[-2000:])
        else:
            assert "failed: coordinator: exited with code 1" in text
            assert "Redis lost the job's state: the plan and generation keys are gone" in text, text[-2000:]
        assert time.monotonic() - killed < 30
    finally:
        redis.stop()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="the testbed needs root and iproute2")
@pytest.mark.timeout(300)
def test_partition_between_a_worker_and_a_shard_healed_after_10s(tmp_path, reference):
    run = Run(tmp_path, command="testbed")
    run.wait_round(1, 20, timeout_s=240)
    namespace = subprocess.run(["ip", "netns", "identify", str(run.pid("worker1"))], capture_output=True,
                               text=True, check=True).stdout.strip()
    hosts = Path(f"/etc/netns/{namespace}/hosts").read_text().splitlines()
    shard = next(line.split()[0] for line in hosts if line.split()[1:] == ["ps0"])
    rule = ["ip", "netns", "exec", namespace, "ip", "rule", "{}", "to", f"{shard}/32", "blackhole"]
    subprocess.run([part.format("add") for part in rule], check=True)  # policy routing: drop worker1 -> ps0
    time.sleep(10)
    subprocess.run([part.format("del") for part in rule], check=True)
    code, output = run.finish()
    assert code == 0, output
    # the partition is noticed: either a recovery, or the shard drops the silent connection (--stream-idle-s) and
    # the worker's data channel connects again once the partition heals; whichever came first, exact parameters
    assert ("starting generation 1" in run.log("coordinator")
            or "rejected on the data channel (DEADLINE_EXCEEDED" in run.log("ps0")), run.log("coordinator")
    assert same_parameters(run.model, reference.model)  # nothing counted twice, nothing lost


def held_connection(ports: dict, worker: int) -> socket.socket:
    """A data connection of ``worker`` in generation 0, through its HELLO (what a worker's pool holds)."""
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
    reply = stub.OpenChannel(ps_pb2.ChannelRequest(worker=worker, generation=0), timeout=10)
    sock = socket.create_connection(("127.0.0.1", ports["data"]), timeout=10)
    send_frame(sock, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token, worker=worker, generation=0))
    assert read_header(sock, 0, "test").kind == Kind.WELCOME
    return sock


@pytest.mark.timeout(300)
def test_a_job_under_a_flood_of_strangers_loses_a_worker_and_recovers_bit_exact(tmp_path, reference):
    """Both shards' data channels flooded for the whole job with 1,100 connections each that never complete a
    HELLO (each reopened as soon as the shard ends it), and worker 1 killed with -9: the job recovers and ends
    bit-identical to the fault-free run, no worker dies of a full table. A generation-0 connection held open
    (--stream-idle-s 60, so that only the recovery can end it) is closed when the shard restores generation 1.
    Before, the strangers filled the table, the workers' next connections were refused with RESOURCE_EXHAUSTED
    (fatal) and the job failed."""
    run = Run(tmp_path, IMERGE_STREAM_IDLE_S="60")
    ports = [run._until(lambda role=role: _ports(run, role), f"{role}'s ports", 60) for role in ("ps0", "ps1")]
    flood = Flood([p["data"] for p in ports], 1100)
    try:
        held = held_connection(ports[0], 1)
        run.wait_round(1, 8)
        run.signal("worker1", signal.SIGKILL)
        run.wait_recovered(1)
        held.settimeout(10)
        try:
            assert held.recv(1) == b""  # closed by the shard at its restore
        except ConnectionResetError:
            pass
        code, output = run.finish()
    finally:
        flood.stop()
    assert code == 0, output
    assert flood.ended > 1100, flood.ended  # the shards kept ending strangers
    text = " ".join(output.split())
    assert "worker1 exited with code -9 (restart 1 of 2)" in text and "code 76" not in text
    assert "data connections of older generations ended" in run.log("ps0")
    assert same_parameters(run.model, reference.model)


def _ports(run: Run, role: str) -> dict | None:
    try:
        ports = json.loads((run.logs / "ports" / f"{role}.json").read_text())
    except (OSError, ValueError):
        return None
    return ports if "data" in ports and "grpc" in ports else None


@pytest.mark.timeout(300)
def test_a_deleted_newest_checkpoint_falls_back_to_the_previous_common_round(tmp_path, reference, redis_server):
    """Shard 1 (stopped meanwhile, so Redis still lists it) loses its copy of the round a recovery will pick,
    then shard 0 dies: the recovery picks that round, shard 1 cannot read it, sets it aside and reports it, and
    the next generation starts from the newest round both still hold. The result is still bit-exact."""

    run = Run(tmp_path, "--redis-url", redis_server.url, "--job", "fallback",
              IMERGE_CHECKPOINT_KEEP="4")  # 4 each: rounds in common however the shards' writes interleave
    run.wait_round(1, 20)
    run.signal("ps1", signal.SIGSTOP)
    run.signal("ps0", signal.SIGKILL)
    # Whichever round the recovery picks (the newest of shard 1's list that shard 0 lists, as it died or as its
    # restart republishes it, and a publication still on its way to Redis may count too), it is newer than
    # the oldest round both shards hold on disk: shard 1 loses every round newer than that one, so it cannot
    # restore the pick, reports it, and the next generation starts from that oldest common round.
    on_disk = [set(CheckpointStore(run.logs / "checkpoints", shard).rounds()) for shard in (0, 1)]
    common = sorted(on_disk[0] & on_disk[1])
    assert len(common) >= 2, on_disk  # 4 kept on each, every 4 rounds: the pick is newer than the oldest
    fallback = common[0]
    lost = sorted(r for r in on_disk[1] if r > fallback)
    for round_ in lost:
        shutil.rmtree(run.logs / "checkpoints" / "shard-1" / f"round-{round_:012d}")
    run.wait_generation_started(1)
    run.signal("ps1", signal.SIGCONT)
    code, output = run.finish()
    assert code == 0, output
    assert re.search(rf"could not restore generation \d+ from round ({'|'.join(map(str, lost))}):",
                     run.log("ps1")), run.log("ps1")
    assert re.search(rf"starting generation \d+ from the checkpoint of round {fallback}\n", run.log("coordinator"))
    assert same_parameters(run.model, reference.model)


@pytest.mark.timeout(300)
def test_a_shard_killed_while_the_cost_model_profiles_is_recovered_and_profiling_starts_over(tmp_path):
    run = Run(tmp_path, "--fusion", "cost", "--profile-iters", "60", iters=100)
    run.wait_round(0, 8)
    run.signal("ps0", signal.SIGKILL)
    code, output = run.finish()
    assert code == 0, output
    coordinator = run.log("coordinator")
    assert "starting generation 1" in coordinator and "cost plan from alpha" in coordinator, coordinator[-3000:]
    assert coordinator.index("starting generation 1") < coordinator.index("cost plan from alpha")
