"""Bad input gets a clear gRPC status from a real shard, and never harms a concurrent job."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch

import imerge
from helpers import status_of
from imerge.core.planning import FIRST_PLAN
from imerge.ops.redis_server import free_port
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

import test_equivalence as eq

NUMEL = 1000
SGD = ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}')


@pytest.fixture
def shard(redis_url):
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="badinput", register=False, pull_timeout_s=1.0))
    yield server
    server.stop()


@pytest.fixture
def stub(shard):
    with grpc.insecure_channel(shard.address) as channel:
        yield ps_pb2_grpc.ParameterServerStub(channel)


def floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def init(stub, block_id="b", numel=NUMEL, workers=2, data=None, optimizer=SGD, **spec):
    spec = ps_pb2.BlockSpec(block_id=block_id, dtype=spec.pop("dtype", ps_pb2.FLOAT32), numel=numel,
                            num_workers=workers, optimizer=optimizer, **spec)
    payload = floats(np.zeros(numel)) if data is None else data
    return stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec), ps_pb2.InitBlockChunk(data=payload)]))


def push(stub, block_id="b", worker=0, round_=0, data=None, numel=NUMEL, dtype=ps_pb2.FLOAT32, chunks=None,
         **encoding):
    header = ps_pb2.PushHeader(block_id=block_id, worker=worker, round=round_, dtype=dtype, numel=numel, **encoding)
    if chunks is None:
        chunks = [floats(np.ones(numel)) if data is None else data]
    messages = [ps_pb2.PushChunk(header=header)] + [ps_pb2.PushChunk(data=c) for c in chunks]
    reply = stub.Push(iter(messages), timeout=10)
    assert len(reply.results) == 1 and reply.results[0].block_id == block_id
    return reply.results[0]


def pull(stub, block_id="b", worker=0, round_=0, timeout_s=0.0):
    return list(stub.Pull(ps_pb2.PullRequest(block_ids=[block_id], worker=worker, round=round_,
                                             timeout_s=timeout_s), timeout=30))


def test_unknown_block_is_not_found(stub):
    for call in (lambda: push(stub, "nope"), lambda: pull(stub, "nope"),
                 lambda: list(stub.Fetch(ps_pb2.FetchRequest(block_ids=["nope"])))):
        code, details = status_of(call)
        assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details


def test_wrong_dtype_or_size_is_invalid_argument(stub):
    init(stub)
    code, details = status_of(lambda: push(stub, dtype=ps_pb2.DTYPE_UNSPECIFIED))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in details
    code, details = status_of(lambda: push(stub, numel=NUMEL + 1, data=floats(np.ones(NUMEL + 1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "got 1001 elements, the block holds 1000" in details
    code, details = status_of(lambda: init(stub, "c", dtype=7))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def sparse(indices, values) -> bytes:
    return np.asarray(indices, dtype="<i4").tobytes() + floats(values)


def test_a_payload_whose_encoding_disagrees_with_the_block_compression_is_invalid_argument(stub):
    init(stub, "h", compression="fp16")
    init(stub, "k", compression="topk:0.01")
    half = np.ones(NUMEL, dtype="<f2").tobytes()
    for block_id, call in (("h", lambda: push(stub, "h")),  # fp32 to an fp16 block
                           ("h", lambda: push(stub, "h", dtype=ps_pb2.FLOAT16, chunks=[sparse([1], [1.0])],
                                              encoding=ps_pb2.SPARSE, nnz=1)),
                           ("k", lambda: push(stub, "k", dtype=ps_pb2.FLOAT16, chunks=[half])),
                           ("k", lambda: push(stub, "k"))):  # dense fp32 to a top-k block
        code, details = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "but the block's compression is" in details, details
    code, details = status_of(lambda: push(stub, "k", chunks=[sparse(range(1001), np.ones(1001))],
                                           encoding=ps_pb2.SPARSE, nnz=1001))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1001 sparse pairs, more than" in details
    code, details = status_of(lambda: init(stub, "z", compression="topk:2"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "compression 'topk:2'" in details
    assert push(stub, "h", dtype=ps_pb2.FLOAT16, chunks=[half]).pushed == 1  # the right encoding is taken


def test_sparse_indices_out_of_range_or_repeated_are_refused_and_nothing_is_applied(stub):
    init(stub, "k", compression="topk:0.01")
    for indices, reason in (([3, NUMEL], "outside 0..999"), ([-1, 5], "outside 0..999"),
                            ([7, 7], "not strictly increasing"), ([9, 4], "not strictly increasing")):
        code, details = status_of(lambda: push(stub, "k", chunks=[sparse(indices, [5.0, 5.0])],
                                               encoding=ps_pb2.SPARSE, nnz=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in details, details
    code, details = status_of(lambda: push(stub, "k", chunks=[sparse([1, 2], [1.0])], encoding=ps_pb2.SPARSE,
                                           nnz=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in details
    # nothing of the refused pushes counts: two good pushes make the round, and only they are averaged (SGD lr 0.1)
    assert push(stub, "k", worker=0, chunks=[sparse([2, 10], [1.0, 2.0])], encoding=ps_pb2.SPARSE, nnz=2).pushed == 1
    assert push(stub, "k", worker=1, chunks=[sparse([10], [4.0])], encoding=ps_pb2.SPARSE, nnz=1).pushed == 2
    reply = pull(stub, "k", worker=0)
    meta = reply[0].meta
    assert meta.encoding == ps_pb2.SPARSE and meta.nnz == 2 and meta.numel == NUMEL  # the parameters that changed
    data = b"".join(chunk.data for chunk in reply[1:])
    assert np.frombuffer(data[:8], "<i4").tolist() == [2, 10]
    assert np.frombuffer(data[8:], "<f4").tolist() == pytest.approx([-0.05, -0.3])
    fetched = list(stub.Fetch(ps_pb2.FetchRequest(block_ids=["k"])))  # a fetch sends every element
    assert fetched[0].meta.encoding == ps_pb2.DENSE and fetched[0].meta.numel == NUMEL


def test_round_that_is_not_current_is_failed_precondition(stub):
    init(stub)
    code, details = status_of(lambda: push(stub, round_=3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "current round is 0" in details
    code, details = status_of(lambda: pull(stub, round_=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # a pull may come before the puller's own push (pipelining): it waits for it, and names who is missing
    code, details = status_of(lambda: pull(stub, worker=1, timeout_s=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "workers [0, 1] have not pushed" in details
    code, details = status_of(lambda: list(stub.Pull(ps_pb2.PullRequest(block_ids=["b", "b"], worker=0),
                                                     timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "asked for twice" in details


def test_non_finite_gradient_is_rejected_and_not_counted(stub):
    init(stub)
    bad = np.ones(NUMEL)
    bad[17] = np.nan
    code, details = status_of(lambda: push(stub, data=floats(bad)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in details
    bad[17] = np.inf
    assert status_of(lambda: push(stub, worker=1, data=floats(bad)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert push(stub).pushed == 1  # the rejected pushes were not counted


def test_finite_check_can_be_switched_off(redis_url):
    server = ThreadedShard(PSConfig(redis_url=redis_url, register=False, check_finite=False))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            init(stub, workers=1)
            assert push(stub, data=floats(np.full(NUMEL, np.nan))).pushed == 1
    finally:
        server.stop()


def test_oversized_truncated_and_malformed_streams(stub):
    init(stub)
    half = floats(np.ones(NUMEL // 2))
    code, details = status_of(lambda: push(stub, chunks=[half, half, half]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than the declared" in details
    code, details = status_of(lambda: push(stub, chunks=[half]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated: 500 of 1000" in details
    code, details = status_of(lambda: push(stub, chunks=[b"\x00" * 7]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "whole number" in details
    code, details = status_of(lambda: stub.Push(iter([ps_pb2.PushChunk(data=half)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "every segment must start with a header" in details
    code, details = status_of(lambda: stub.Push(iter([])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty stream" in details
    code, _ = status_of(lambda: push(stub, chunks=[b"\x00" * (8 << 20)]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # one message above the 2 MiB limit
    assert push(stub).pushed == 1  # and the block still takes a good push


def test_bad_init_requests(stub):
    assert init(stub).created
    assert not init(stub).created  # identical: accepted
    code, details = status_of(lambda: init(stub, data=floats(np.ones(NUMEL))))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "different initial parameters" in details
    code, details = status_of(lambda: init(stub, workers=3))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "different spec" in details
    code, details = status_of(lambda: init(stub, "big", numel=1 << 40, data=b""))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "numel" in details
    code, details = status_of(lambda: init(stub, "opt", optimizer=ps_pb2.OptimizerSpec(name="lbfgs", options_json='{"lr": 1}')))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lbfgs" in details
    code, details = status_of(lambda: init(stub, "lr", optimizer=ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0}')))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lr must be a positive number" in details
    code, details = status_of(lambda: push(stub, worker=9))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "worker 9 outside 0..1" in details


def test_a_retry_is_acknowledged_once_and_a_second_writer_is_refused_naming_both(stub):
    """A retry carries the bytes that were counted: acknowledged as a duplicate. A push of a counted row with other
    bytes is a second client pushing as that worker: ALREADY_EXISTS naming both clients, counted, nothing applied."""
    init(stub, workers=2, optimizer=ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 1.0}'))
    assert push(stub, worker=0, data=floats(np.full(NUMEL, 2.0))).pushed == 1
    reply = push(stub, worker=0, data=floats(np.full(NUMEL, 2.0)))
    assert reply.duplicate and reply.pushed == 1
    code, details = status_of(lambda: push(stub, worker=0, data=floats(np.full(NUMEL, 100.0))))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "two clients push as worker 0" in details and details.count("ipv") == 2  # both clients' addresses
    push(stub, worker=1, data=floats(np.full(NUMEL, 4.0)))
    chunks = pull(stub, worker=0)
    assert chunks[0].meta.round == 1
    params = np.frombuffer(b"".join(c.data for c in chunks[1:]), dtype="<f4")
    np.testing.assert_array_equal(params, np.full(NUMEL, -3.0, dtype=np.float32))  # 0 - 1.0 * (2 + 4) / 2
    assert push(stub, worker=1, round_=0, data=floats(np.full(NUMEL, 4.0))).duplicate  # a late retry
    code, details = status_of(lambda: push(stub, worker=1, round_=0))  # a late second writer
    assert code == grpc.StatusCode.ALREADY_EXISTS and "round 0" in details
    stats = stub.Stats(ps_pb2.StatsRequest())
    assert (stats.pushes, stats.duplicate_pushes, stats.blocks[0].round) == (2, 2, 1)


def test_pull_timeout_names_missing_workers(stub):
    init(stub, workers=3)
    push(stub, worker=0)
    started = time.monotonic()
    code, details = status_of(lambda: pull(stub, worker=0, timeout_s=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "workers [1, 2] have not pushed" in details
    assert time.monotonic() - started < 3


def test_one_stream_carries_several_blocks(stub):
    """A fused group pushes all its blocks on a shard in one stream and pulls them in one call."""
    init(stub, "x", numel=3, workers=1, data=floats([1, 2, 3]))
    init(stub, "y", numel=2, workers=1, data=floats([5, 6]))
    header = lambda block_id, numel: ps_pb2.PushChunk(header=ps_pb2.PushHeader(  # noqa: E731
        block_id=block_id, worker=0, round=0, dtype=ps_pb2.FLOAT32, numel=numel))
    reply = stub.Push(iter([header("x", 3), ps_pb2.PushChunk(data=floats([10, 10, 10])),
                            header("y", 2), ps_pb2.PushChunk(data=floats([10])), ps_pb2.PushChunk(data=floats([10]))]))
    assert [(r.block_id, r.duplicate, r.pushed) for r in reply.results] == [("x", False, 1), ("y", False, 1)]
    deadline = time.monotonic() + 10
    while stub.Stats(ps_pb2.StatsRequest()).rounds_completed < 2:  # both aggregated: none completes during the
        assert time.monotonic() < deadline                         # pull, so they come in the order asked
        time.sleep(0.01)
    chunks = list(stub.Pull(ps_pb2.PullRequest(block_ids=["y", "x"], worker=0, round=0), timeout=10))
    assert [c.meta.block_id for c in chunks if c.WhichOneof("part") == "meta"] == ["y", "x"]
    values = np.frombuffer(b"".join(c.data for c in chunks if c.WhichOneof("part") == "data"), dtype="<f4")
    np.testing.assert_allclose(values, [4, 5, 0, 1, 2], atol=1e-6)  # lr 0.1 * 10 subtracted


def test_stats_report_counters(stub):
    init(stub, workers=1)
    push(stub)
    pull(stub)
    stats = stub.Stats(ps_pb2.StatsRequest())
    assert (stats.pushes, stats.pulls, stats.rounds_completed) == (1, 1, 1)
    assert stats.bytes_received == NUMEL * 4 and stats.bytes_sent == NUMEL * 4
    assert stats.blocks[0].round == 1


def test_bad_requests_do_not_harm_a_concurrent_job(cluster):
    """A job runs while a client hammers the same shards with malformed requests."""
    c = cluster(eq.WORKERS, eq.SHARDS)
    stop = threading.Event()
    rejected: list[grpc.StatusCode] = []
    superseded: list[str] = []  # the attacker pushes as worker 0: a stall of its stream lets the real push take the row

    def attack() -> None:
        channels = [grpc.insecure_channel(a) for a in c.addresses]
        stubs = [ps_pb2_grpc.ParameterServerStub(ch) for ch in channels]
        nan = floats(np.full(650, np.nan))
        attacks = [lambda s: push(s, "b0", numel=650, data=nan),  # NaN into a real block
                   lambda s: push(s, "b0", numel=651, data=floats(np.ones(651))),
                   lambda s: push(s, "b0", round_=10_000, numel=650, data=floats(np.ones(650))),
                   lambda s: push(s, "b1", worker=99, numel=32832, chunks=[b""]),
                   lambda s: pull(s, "b2", worker=1, round_=10_000),
                   lambda s: init(s, "b0", numel=650, workers=3, data=floats(np.ones(100)))]  # truncated
        while not stop.is_set():
            for stub in stubs:
                for hit in attacks:
                    try:
                        hit(stub)
                    except grpc.RpcError as exc:
                        rejected.append(exc.code())
                        if exc.code() == grpc.StatusCode.ABORTED:
                            superseded.append(exc.details())
        for ch in channels:
            ch.close()

    attacker = threading.Thread(target=attack, daemon=True)
    data = eq.batches()
    attacker.start()
    try:
        results = eq.distributed_run(c, eq.OPTIMIZERS["sgd"], data)
    finally:
        stop.set()
        attacker.join(30)
    expected = eq.reference_run(eq.OPTIMIZERS["sgd"], data)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)
    assert len(rejected) > 20
    assert grpc.StatusCode.OK not in rejected
    assert set(rejected) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                             grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED}
    # the attacker's push as worker 0 of round 0, superseded by the job's worker 0 pushing a later round: named as that
    # push, or (once the job's push of round 0 was counted) as a duplicate of round 0
    assert all("round 0" in why.split(" while ")[0] and "while a newer push of block b0 by worker 0" in why
               for why in superseded), superseded


def test_health_service_reports_serving(shard):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(shard.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "imerge.v1.ParameterServer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        code, _ = status_of(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5))
        assert code == grpc.StatusCode.NOT_FOUND
        for method in ("Check", "Watch"):  # bytes that are not a request: INVALID_ARGUMENT, never UNKNOWN
            call = (channel.unary_unary if method == "Check" else channel.unary_stream)(
                f"/grpc.health.v1.Health/{method}", request_serializer=bytes, response_deserializer=bytes)
            code, details = status_of(lambda: list(call(b"\xff\xff\xff", timeout=5)) if method == "Watch"
                                      else call(b"\xff\xff\xff", timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "HealthCheckRequest" in details, (method, details)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def vm_peak_mib(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmPeak:\s+(\d+) kB", status).group(1)) / 1024


def test_huge_claims_with_tiny_bodies_allocate_nothing(tmp_path):
    """Sizes are checked before any allocation: a shard process's memory peak does not move by what a
    header claims (the largest legal block is 1 GiB of fp32; the body is 4 bytes)."""
    port = free_port()
    shard = subprocess.Popen([sys.executable, "-m", "imerge", "ps", "--no-register", "--host", "127.0.0.1",
                              "--port", str(port), "--metrics-port", "-1"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            init(stub, "warm-up")  # the first request's own allocations are not the claim's
            before = vm_peak_mib(shard.pid)
            code, details = status_of(lambda: init(stub, "huge", numel=10**9, data=floats([0.0])))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "numel 1000000000 outside" in details
            legal = PSConfig().max_block_numel
            code, details = status_of(lambda: init(stub, "claims", numel=legal, workers=4096, data=floats([0.0])))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and f"truncated: 1 of {legal}" in details
            grown = vm_peak_mib(shard.pid) - before
            assert grown < 256, f"the shard's memory peak grew {grown:.0f} MiB for a 4-byte body"
    finally:
        shard.terminate()
        shard.wait(30)


def test_a_worker_count_that_is_not_the_jobs_is_refused(cluster):
    """The rows a block allocates are bounded by the job's worker count, from the mapping table."""
    c = cluster(2, 1)

    def body(rank):
        imerge.distribute(eq.build_model("digits-cnn", seed=0), eq.OPTIMIZERS["sgd"], c.worker_config(rank)).close()

    c.run_workers(body)
    block = c.coordinator.store.read_plan(FIRST_PLAN).plan.blocks[0]
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        code, details = status_of(lambda: init(stub, block.block_id, numel=block.numel, workers=4000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_workers 4000, but job" in details
