"""The shard's pulls share its uplink in the order they were asked (--pull-order arrival): the policy, over
fake meters and a fake clock; the meter, over a real socket whose bytes wait in a real shaped queue."""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from imerge.wire.datapath import host_queued_bytes
from services.ps.turns import LOW_WATER_BYTES, MAX_WAIT_S, POLL_S, PullTurns

CLONE_NEWNET = 0x40000000


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


class Queue:
    """A connection's bytes on the host: drains ``per_look`` bytes each time it is read."""

    def __init__(self, queued: int, per_look: int = 0, closed: bool = False):
        self.queued, self.per_look, self.closed, self.looks = queued, per_look, closed, 0

    def __call__(self) -> int:
        if self.closed:
            raise OSError("closed")
        self.looks += 1
        queued, self.queued = self.queued, max(0, self.queued - self.per_look)
        return queued


def turns(order: str = "arrival") -> tuple[PullTurns, FakeTime]:
    fake = FakeTime()
    return PullTurns(order, clock=fake.clock, sleep=fake.sleep), fake


def test_a_later_pull_waits_until_the_earlier_ones_bytes_have_left_the_host():
    order, fake = turns()
    first = order.ask("worker 0's connection", Queue(10 * LOW_WATER_BYTES, per_look=LOW_WATER_BYTES))
    second = order.ask("worker 1's connection", Queue(0))
    assert first.wait() == 0.0  # nobody asked before it
    waited = second.wait()
    assert 0 < waited < MAX_WAIT_S and fake.sleeps == 8  # it went once the first one's queue fell to the low water


def test_an_earlier_pull_never_waits_for_a_later_one():
    order, fake = turns()
    first = order.ask("a", Queue(0))
    second = order.ask("b", Queue(10 * LOW_WATER_BYTES))
    assert second.wait() == 0.0
    assert first.wait() == 0.0 and fake.sleeps == 0


def test_a_reader_that_stalls_holds_the_others_back_for_at_most_the_longest_wait():
    order, fake = turns()
    stalled = order.ask("stalled", Queue(1 << 20))
    stalled.wait()
    waited = order.ask("next", Queue(0)).wait()
    assert MAX_WAIT_S <= waited < MAX_WAIT_S + 0.001


def test_a_ready_pull_whose_thread_is_stuck_holds_the_others_back_once():
    order, fake = turns()
    stuck = order.ask("stuck in a write", Queue(0))
    stuck.ready()  # its next block is ready; its thread still writes the last one to a worker that stopped reading
    assert MAX_WAIT_S <= order.ask("next", Queue(0)).wait() < MAX_WAIT_S + 0.001
    assert order.ask("after", Queue(0)).wait() == 0.0  # passed over until it sends
    stuck.wait()
    stuck.ready()  # it sent, and is ready again: it holds its place
    assert order.ask("last", Queue(0)).wait() >= MAX_WAIT_S


def test_a_pull_woken_first_sends_first_whichever_thread_runs_first():
    """A round's completion marks its pulls ready together: the later one waits until the earlier one's thread
    has sent its block and the block has drained to the low water."""
    fake = FakeTime()
    ahead_queue = Queue(0, per_look=LOW_WATER_BYTES)

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if fake.sleeps == 3:  # the earlier pull's thread runs at last: its block goes to the host's queue
            ahead_queue.queued = 2 * LOW_WATER_BYTES
            assert ahead.wait() == 0.0

    order = PullTurns(clock=fake.clock, sleep=sleep)
    ahead = order.ask("ahead", ahead_queue)
    behind = order.ask("behind", Queue(0))
    ahead.ready(), behind.ready()  # by the thread that completed the round, in the order asked
    assert behind.wait() > 0 and fake.sleeps == 4


def test_a_pull_woken_for_nothing_or_ended_holds_nobody():
    order, fake = turns()
    spurious, ended = order.ask("spurious", Queue(0)), order.ask("ended", Queue(0))
    spurious.ready()
    spurious.idle()  # it looked and found no block to send
    ended.ready()
    ended.close()  # refused, or its connection failed
    assert order.ask("later", Queue(0)).wait() == 0.0 and fake.sleeps == 0


def test_drained_and_closed_connections_leave_the_order():
    order, fake = turns()
    closed = Queue(1 << 20)
    order.ask("closed", closed).wait()  # each sent a block
    closed.closed = True
    drained = Queue(0)
    order.ask("drained", drained).wait()
    last = order.ask("last", Queue(0))
    assert last.wait() == 0.0 and fake.sleeps == 0
    assert last.wait() == 0.0 and drained.looks == 1  # looked at once, then gone from the order


def test_a_connections_newer_pull_takes_the_place_of_its_older_one():
    order, _ = turns()
    old = order.ask("worker 0", Queue(1 << 20))
    old.ready()
    middle = order.ask("worker 1", Queue(0))
    order.ask("worker 0", Queue(1 << 20)).ready()  # worker 0's next pull, on the same connection
    assert middle.wait() == 0.0


def test_many_waiting_pulls_go_in_order_and_only_the_first_one_polls():
    """With many workers, a round's pulls wait together: one thread looks at the queue, the others sleep until
    the one before them goes, and they go in the order they were asked."""
    order = PullTurns(max_wait_s=2.0)  # none waits its longest: the order shows
    until = time.monotonic() + 0.05
    looks = []

    def earlier_queue() -> int:
        looks.append(1)
        return 1 << 20 if time.monotonic() < until else 0

    order.ask("earlier", earlier_queue).wait()
    waiters = [order.ask(f"worker {i}", Queue(0)) for i in range(8)]
    went: list[int] = []
    lock = threading.Lock()

    def run(turn) -> None:
        turn.wait()
        with lock:
            went.append(turn.number)

    threads = [threading.Thread(target=run, args=(turn,)) for turn in reversed(waiters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert went == sorted(went) and len(went) == 8
    assert len(looks) < 0.05 / POLL_S * 2 + 40, len(looks)  # one poller at a time, not eight


def test_off_never_waits():
    order, fake = turns("off")
    order.ask("a", Queue(1 << 20)).ready()
    assert order.ask("b", Queue(0)).wait() == 0.0 and fake.sleeps == 0


def test_auto_takes_turns_only_where_one_shard_holds_the_jobs_blocks():
    order, fake = turns("auto")
    assert order.enabled  # one shard until the plan says otherwise
    order.ask("a", Queue(1 << 20)).ready()
    assert order.ask("b", Queue(0)).wait() >= MAX_WAIT_S
    order.shards = 3  # several shards would all serve the same worker first
    order.ask("c", Queue(1 << 20)).ready()
    assert not order.enabled and order.ask("d", Queue(0)).wait() == 0.0
    with pytest.raises(ValueError, match="one of auto, arrival, off"):
        PullTurns("fifo")


# -- the meter, on a real shaped queue ---------------------------------------------------------------------------
def _in_namespace(name: str, function: Callable[[], object]) -> object:
    """Run ``function`` on a thread inside network namespace ``name`` (the sockets it makes stay there)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                outcome["error"] = OSError(ctypes.get_errno(), "setns")
                return
            outcome["value"] = function()
        finally:
            os.close(fd)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]


@pytest.fixture
def shaped_namespace() -> Iterator[str]:
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"):
        pytest.skip("needs root, ip and tc (a network namespace with a shaped loopback)")
    name = f"imturns{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "mtu", "9000", "up"], check=True)
        subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "8mbit", "burst",
                        "64kb", "limit", "2mb"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_the_meter_counts_the_bytes_waiting_in_the_hosts_queue_until_they_leave(shaped_namespace):
    def connect() -> tuple[socket.socket, socket.socket, socket.socket]:
        listener = socket.create_server(("127.0.0.1", 0))
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
        return listener, sender, receiver

    listener, sender, receiver = _in_namespace(shaped_namespace, connect)  # type: ignore[misc]
    with listener, sender, receiver:
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        assert host_queued_bytes(sender) == 0
        received = bytearray()

        def read() -> None:
            while len(received) < 512 << 10 and (chunk := receiver.recv(1 << 16)):
                received.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        sender.sendall(b"x" * (512 << 10))  # 0.5 s of the 8 Mbit/s queue
        peak = 0

        def seen_queued() -> bool:
            nonlocal peak
            peak = max(peak, host_queued_bytes(sender))
            return peak > LOW_WATER_BYTES

        assert _until(seen_queued, 1.0), f"at most {peak} bytes seen queued on the host"
        reader.join(10)
        assert len(received) == 512 << 10
        assert _until(lambda: host_queued_bytes(sender) == 0, 2.0)
    with pytest.raises(OSError):
        host_queued_bytes(sender)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_shard_takes_the_jobs_shard_count_from_its_plan(cluster, shards):
    """Whether the pulls take turns by default depends on how many shards feed a worker (--pull-order auto):
    each shard reads the count from the job's plan, and takes turns only where it is the job's one shard."""
    import torch

    import imerge
    from imerge.core.optim import OptimizerSpec

    c = cluster(1, shards)
    model = imerge.distribute(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                              OptimizerSpec("sgd", lr=0.01), c.worker_config(0, partition_mib=0.01))
    model(torch.randn(4, 64)).square().mean().backward()
    model.synchronize()
    model.close()
    assert [shard.server.channel.turns.shards for shard in c.shards] == [shards] * shards
    assert [shard.server.channel.turns.enabled for shard in c.shards] == [shards == 1] * shards

