"""The data channel under hostile clients: no client without a token can fill it, hold a row or end a job.

Each test is one attack over real sockets on a real shard process (``imerge ps``), with the worker's own
client beside it where the attack aimed at a worker: strangers (connections that never complete a HELLO)
filling the table, a HELLO that declares a large meta, a duplicate push declaring more than its block, an
older round's duplicate holding the row, a payload dripped past its block's time at the minimum rate, a
connection used for another generation than its HELLO's, a reset between calls.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from flood import Flood
from imerge.core.errors import Busy
from imerge.ps.admission import Admission, AdmissionLimits
from imerge.wire.datapath import HEADER, MAGIC, Kind, send_frame
from imerge.wire.rpc import ps_pb2
from imerge.worker.items import PushItem
from imerge.worker.transport import ShardClient
from test_datachannel import NUMEL, WORKERS, Raw, block_stats, gradient, push_header, shard, shard_process  # noqa: F401
from test_request_bounds import SGD, ShardProcess
import test_datachannel


# -- the admission policy, alone ----------------------------------------------------------------------------
def test_a_stranger_evicts_the_oldest_stranger_never_an_admitted_connection():
    table = Admission(AdmissionLimits(max_connections=4, max_pending=2, handshake_s=5.0))
    assert table.accept("w0", 0.0) == (True, []) and table.admit("w0")
    assert table.accept("s1", 1.0) == (True, []) and table.accept("s2", 2.0) == (True, [])
    assert table.accept("s3", 3.0) == (True, ["s1"])  # the pending places are full: the oldest stranger goes
    assert not table.admit("s1")  # its HELLO came too late: it was ended
    assert table.admit("s2") and table.accept("w4", 4.0) == (True, []) and table.admit("w4")
    assert table.accept("s5", 5.0) == (True, ["s3"])  # the whole table is full: a stranger makes room
    assert table.admit("s5") and (table.admitted, table.pending) == (4, 0)
    assert table.accept("x", 6.0) == (False, [])  # full of admitted connections: refused, nobody evicted
    table.release("w0")
    assert table.accept("y", 7.0) == (True, [])
    assert table.expired(11.9) == [] and table.next_deadline() == 12.0 and table.expired(12.0) == ["y"]
    assert table.evicted == 2


# -- strangers ----------------------------------------------------------------------------------------------
def data_port(shard: ShardProcess) -> int:
    return json.loads((shard.log.parent / "ports.json").read_text())["data"]


def init_block(shard: ShardProcess, block_id: str = "b") -> None:
    spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS,
                            optimizer=SGD)
    shard.stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                               ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)


class MemorySampler:
    """The shard's resident memory, sampled every 50 ms until stopped: the peak, MB."""

    def __init__(self, shard: ShardProcess):
        self.peak = shard.memory_mb("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(shard,), daemon=True)
        self._thread.start()

    def _run(self, shard: ShardProcess) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, shard.memory_mb("VmRSS"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def train_round(address: str, block_id: str, round_: int) -> list[torch.Tensor]:
    """Both workers push a round through the worker's own client and pull its result."""
    grads = [torch.full((NUMEL,), float(w + 1)) for w in range(WORKERS)]

    async def worker(rank: int) -> torch.Tensor:
        client = ShardClient(address, data_path="socket")
        target = torch.empty(NUMEL)
        try:
            await client.push([PushItem(block_id, grads[rank], round_)], rank, timeout_s=30)
            await client.pull_into([(block_id, target)], rank, round_, 30)
        finally:
            await client.close()
        return target

    async def both() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(worker(rank) for rank in range(WORKERS))))

    return asyncio.run(asyncio.wait_for(both(), 60))


@pytest.mark.timeout(240)
def test_a_flood_of_strangers_neither_takes_a_workers_place_nor_the_shards_memory(tmp_path):
    """1,100 connections that send a HELLO's header and a byte of it, then a byte every 0.5 s (never idle), each
    reopened as soon as the shard ends it, against --max-data-connections 128: the workers' pushes and pulls
    go through meanwhile, every stranger is ended within --handshake-timeout-s (2 s here; the flood notices within 6 s), and then 1,024
    HELLOs declaring a 2 MiB meta are refused at once. The shard's memory stays within 64 MB of idle. Before,
    strangers held their places for as long as they dripped, a worker's HELLO got RESOURCE_EXHAUSTED (fatal),
    and each large HELLO allocated its 2 MiB before a byte of it came."""
    shard = ShardProcess(tmp_path, "--max-data-connections", "128", "--handshake-timeout-s", "2",
                         "--stream-idle-s", "4")
    try:
        init_block(shard)
        port = data_port(shard)
        train_round(shard.address, "b", 0)  # the steady state: a round's buffers exist
        time.sleep(0.5)
        idle = shard.memory_mb("VmRSS")
        memory = MemorySampler(shard)
        flood = Flood([port], 1100)
        try:
            deadline = time.monotonic() + 60
            while flood.opened < 1100:
                assert time.monotonic() < deadline, f"the flood opened {flood.opened} connections in 60 s"
                time.sleep(0.1)
            started = time.monotonic()
            results = train_round(shard.address, "b", 1)
            took = time.monotonic() - started
            time.sleep(3.0)  # every stranger of the first wave is past its deadline
        finally:
            flood.stop()
        assert all(torch.equal(result, results[0]) for result in results)
        assert flood.ended >= 1100 and max(flood.lifetimes) < 6.0, (flood.ended, max(flood.lifetimes))  # 2 s + the
        # flood's own loop, which notices an end only between two rounds of opening
        assert took < 20, f"a round took {took:.1f}s under the flood"

        refused = 0
        for _ in range(1024):  # a HELLO declaring a 2 MiB meta, then 1 byte of it
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(HEADER.pack(MAGIC, Kind.HELLO, 0, 0, 2 << 20, 0) + b"\0")
            header = sock.recv(HEADER.size, socket.MSG_WAITALL)
            refused += len(header) == HEADER.size and HEADER.unpack(header)[1] == Kind.ERROR
            sock.close()
        assert refused == 1024
        peak = memory.stop()
        print(f"strangers opened {flood.opened}, ended {flood.ended}, longest lived {max(flood.lifetimes):.2f}s; "
              f"round under the flood {took:.2f}s; RSS idle {idle:.0f} MB, peak {peak:.0f} MB")
        assert peak - idle < 64, f"the shard grew from {idle:.0f} MB to {peak:.0f} MB under the flood"
        time.sleep(1.0)
        assert shard.memory_mb("VmRSS") - idle < 64
        log = shard.log.read_text()
        assert "HELLO frame's meta of 2097152 bytes is more than the 256" in log
        assert "internal error" not in log and "Traceback" not in log
    finally:
        shard.stop()


def test_a_worker_meeting_a_table_full_of_workers_tries_again_until_a_place_frees(tmp_path):
    """--max-data-connections 2, both held by admitted connections: the worker's client is answered Busy
    (UNAVAILABLE, recoverable) and tries again, and its push goes through once a place frees. Before, the
    refusal was RESOURCE_EXHAUSTED, which ends a worker (exit 76) and the job."""
    shard = ShardProcess(tmp_path, "--max-data-connections", "2")
    try:
        init_block(shard)
        held = [Raw(shard, worker=1) for _ in range(2)]
        assert all(raw.answer()[0] == Kind.WELCOME for raw in held)
        third = Raw(shard, worker=1)
        kind, (error, message) = third.answer()
        assert (kind, error) == (Kind.ERROR, "Busy") and "--max-data-connections" in message
        assert issubclass(Busy, Exception) and Busy.recoverable and Busy.status == "UNAVAILABLE"
        threading.Timer(1.0, held[0].close).start()

        async def push() -> float:
            client = ShardClient(shard.address, data_path="socket")
            started = time.monotonic()
            try:
                reply = await client.push([PushItem("b", torch.ones(NUMEL), 0)], 0, timeout_s=20)
            finally:
                await client.close()
            assert reply.results[0].pushed == 1
            return time.monotonic() - started

        assert 0.8 < asyncio.run(push()) < 10
        held[1].close()
    finally:
        shard.stop()


# -- pushes on the module's shard (--stream-idle-s 2, --stream-min-bytes-per-s 16384) --------------------------
def complete_round_0(shard) -> None:
    for worker in range(WORKERS):
        raw = Raw(shard, worker=worker)
        assert raw.answer()[0] == Kind.WELCOME
        send_frame(raw.sock, Kind.PUSH, push_header(worker=worker), [gradient(1.0)])
        assert raw.answer()[0] == Kind.RESULT
        raw.close()
    deadline = time.monotonic() + 10
    while block_stats(shard).round != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def start_duplicate(shard, declared: int) -> Raw:
    """Worker 0's push of round 0 declaring ``declared`` bytes, 400 of them sent."""
    duplicate = Raw(shard)
    assert duplicate.answer()[0] == Kind.WELCOME
    meta = push_header(round_=0).SerializeToString()
    duplicate.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), declared) + meta + b"\0" * 400)
    return duplicate


def assert_counted_at_once(shard) -> None:
    """Worker 0's honest push of round 1 is counted within half a second."""
    honest = Raw(shard)
    assert honest.answer()[0] == Kind.WELCOME
    started = time.monotonic()
    send_frame(honest.sock, Kind.PUSH, push_header(round_=1), [gradient(2.0)])
    kind, result = honest.answer(timeout_s=5)
    assert kind == Kind.RESULT and result.pushed == 1 and time.monotonic() - started < 0.5


def test_a_hello_declaring_more_meta_than_a_hello_holds_is_refused_at_once(shard):
    raw = Raw(shard, hello=False)
    raw.sock.sendall(HEADER.pack(MAGIC, Kind.HELLO, 0, 0, 2 << 20, 0) + b"\0" * 21)
    kind, (error, message) = raw.answer(timeout_s=1)
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and "more than the 256" in message


@pytest.mark.parametrize("declared", [1 << 30, 256 << 20, NUMEL * 4 + 4, NUMEL * 4 - 4])
def test_a_duplicate_declaring_another_size_than_its_block_is_refused_before_a_byte_is_read(shard, declared):
    """Round 0 is counted; a NaN push of round 1 is refused (the row no longer holds a counted round); then a
    push of round 0 (a duplicate) declares ``declared`` bytes and drips: refused at once, and worker 0's
    honest push of round 1 is counted at once. Before, the duplicate's length went unchecked while it held the
    row (a 1 GiB one at 24 KiB/s held it for good; a 256 MiB one was acknowledged)."""
    complete_round_0(shard)
    nan = Raw(shard)
    assert nan.answer()[0] == Kind.WELCOME
    send_frame(nan.sock, Kind.PUSH, push_header(round_=1), [np.full(NUMEL, np.nan, "<f4").tobytes()])
    assert nan.answer()[1][0] == "InvalidArgument"
    duplicate = start_duplicate(shard, declared)
    kind, (error, message) = duplicate.answer(timeout_s=1)
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and f"declares {declared} bytes" in message
    assert_counted_at_once(shard)


def test_a_grpc_duplicate_carrying_more_than_its_block_is_refused(shard):
    """gRPC's path: after the NaN push of round 1 a duplicate of round 0 is dropped unread, and dropping it was
    unbounded (three blocks' worth was acknowledged as a duplicate)."""
    complete_round_0(shard)
    nan = [ps_pb2.PushChunk(header=push_header(round_=1)), ps_pb2.PushChunk(data=gradient(float("nan")))]
    with pytest.raises(grpc.RpcError, match="NaN"):
        shard.stub.Push(iter(nan), timeout=10)
    chunks = [ps_pb2.PushChunk(header=push_header(round_=0))] + [ps_pb2.PushChunk(data=gradient(1.0))] * 3
    with pytest.raises(grpc.RpcError) as refused:
        shard.stub.Push(iter(chunks), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than the block's {NUMEL * 4} bytes" in refused.value.details()


def test_a_push_of_the_current_round_supersedes_an_older_rounds_duplicate_at_once(shard):
    """A correctly sized duplicate of round 0 drips (40 bytes every 0.1 s) while worker 0 pushes round 1: the
    duplicate is ended at once, not after the second a stalled holder gets."""
    complete_round_0(shard)
    duplicate = start_duplicate(shard, NUMEL * 4)
    stop = threading.Event()
    threading.Thread(target=lambda: [duplicate.sock.send(b"\0" * 40) for _ in iter(lambda: stop.wait(0.1), True)],
                     daemon=True).start()
    try:
        time.sleep(0.2)
        assert_counted_at_once(shard)
    finally:
        stop.set()


class Holder:
    """A push stream holding a row, as the row's waiters see it."""

    def __init__(self, budget_s: float | None, stalled: bool = False):
        self.until = None if budget_s is None else time.monotonic() + budget_s
        self.is_stalled, self.superseded = stalled, ""

    def budget_left_s(self) -> float | None:
        return None if self.until is None else self.until - time.monotonic()

    def stalled(self, seconds: float) -> bool:
        return self.is_stalled

    def supersede(self, why: str) -> None:
        self.superseded = why


@pytest.mark.parametrize("budget_s, holder_round, within", [(0.3, 1, (0.25, 0.6)), (None, 0, (0.0, 0.2)),
                                                            (5.0, 0, (0.0, 0.2))])
def test_a_waiting_push_ends_a_holder_past_its_budget_or_of_an_older_round(budget_s, holder_round, within):
    """The row's rule alone: a holder that keeps the rate (never stalled) is ended by a waiting push of the
    current round (1) once its payload's budget is spent, and at once if it pushes round 0, a duplicate."""
    from imerge.ps.streams import Row

    async def run() -> tuple[float, str]:
        row, holder = Row(), Holder(budget_s)
        entered, release = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with row.held(holder_round, holder, "push of round 0", lambda: 1):
                entered.set()
                while not holder.superseded:
                    await asyncio.sleep(0.01)

        task = asyncio.ensure_future(hold())
        await entered.wait()
        started = time.monotonic()
        async with row.held(1, None, "push of round 1", lambda: 1):
            took = time.monotonic() - started
        await task
        return took, holder.superseded

    took, why = asyncio.run(asyncio.wait_for(run(), 10))
    assert within[0] <= took < within[1], took
    assert ("duplicate of round 0" if holder_round == 0 else "longer than its size at the minimum rate") in why


def test_a_row_held_by_a_connections_thread_is_waited_for_on_the_loop_and_a_waiter_keeps_its_turn():
    """A data connection's thread takes a free row without the event loop (``try_hold``); a push on the loop waits
    for it, superseding it by the row's rule, and gets it as soon as the thread lets go; while a push waits on
    the loop, a thread cannot take the row past it."""
    from imerge.ps.streams import Row

    async def run() -> tuple[float, bool, bool]:
        row, holder = Row(), Holder(None)
        assert row.try_hold(0, holder) and not row.try_hold(0, holder)
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (time.sleep(0.3), row.release()))
        started = time.monotonic()
        async with row.held(0, None, "push of round 0", lambda: 0):
            took = time.monotonic() - started
            jumped = row.try_hold(0, holder)  # held on the loop now
        assert row.try_hold(0, holder)  # free again: a thread takes it
        waiting = asyncio.ensure_future(row.held(0, None, "push of round 0").__aenter__())
        await asyncio.sleep(0.05)  # a push waits for it on the loop
        row.release()  # the thread lets go: the waiter is told, but has not run yet
        past_waiter = row.try_hold(0, holder)  # another thread's push does not pass it
        await asyncio.wait_for(waiting, 5)
        return took, jumped, past_waiter

    took, jumped, past_waiter = asyncio.run(asyncio.wait_for(run(), 10))
    assert 0.25 <= took < 0.6 and not jumped and not past_waiter


def test_a_connection_carries_only_its_hellos_generation(shard):
    raw = Raw(shard)
    assert raw.answer()[0] == Kind.WELCOME
    send_frame(raw.sock, Kind.PUSH, push_header(generation=1), [gradient(1.0)])
    kind, (error, message) = raw.answer()
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and "data connection of generation 0" in message
    pull = Raw(shard)
    assert pull.answer()[0] == Kind.WELCOME
    send_frame(pull.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=[test_datachannel.BLOCK], worker=0, round=0,
                                                        generation=2))
    assert pull.answer()[1][0] == "InvalidArgument"


def test_a_peer_reset_between_calls_is_no_error_in_the_shards_log(shard):
    before = shard.log.read_text()
    for _ in range(3):
        raw = Raw(shard)
        assert raw.answer()[0] == Kind.WELCOME
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()  # a reset, not a close
    time.sleep(0.5)
    new = shard.log.read_text()[len(before):]
    assert "internal error" not in new and "Traceback" not in new and "ERROR" not in new, new
