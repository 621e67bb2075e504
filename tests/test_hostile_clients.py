"""Clients written to harm a shard: every refusal is a status naming the field, and changes nothing.

A real shard (gRPC on a real socket, no store), raw clients that send what no worker would: optimizer options and
round hyperparameters of the wrong kind, out of range, a flag toggled mid-run, huge integers, deep nesting; pushes
that queue behind a silent row holder and race to take the row over. The oracle everywhere: no INTERNAL, and what
a refused call carried is nowhere in the shard's state.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import grpc
import numpy as np
import pytest

from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

NUMEL = 64


@pytest.fixture
def stub(redis_url):
    shard = ThreadedShard(PSConfig(redis_url=redis_url, job="hostile", register=False, pull_timeout_s=2.0))
    with grpc.insecure_channel(shard.address) as channel:
        yield ps_pb2_grpc.ParameterServerStub(channel)
    shard.stop()


def floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def init(stub, block_id: str, options_json: str, name: str = "adam", workers: int = 1):
    spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=workers,
                            optimizer=ps_pb2.OptimizerSpec(name=name, options_json=options_json))
    return stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec), ps_pb2.InitBlockChunk(data=floats(np.zeros(NUMEL)))]),
                          timeout=30)


def push_messages(block_id: str, worker: int = 0, round_: int = 0, value: float = 1.0, **header):
    return [ps_pb2.PushChunk(header=ps_pb2.PushHeader(block_id=block_id, worker=worker, round=round_,
                                                      dtype=ps_pb2.FLOAT32, numel=NUMEL, **header)),
            ps_pb2.PushChunk(data=floats(np.full(NUMEL, value)))]


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value.code(), info.value.details()


def params(stub, block_id: str) -> np.ndarray:
    chunks = list(stub.Fetch(ps_pb2.FetchRequest(block_ids=[block_id]), timeout=10))
    return np.frombuffer(b"".join(c.data for c in chunks if c.WhichOneof("part") == "data"), "<f4")


BAD_OPTIONS = [
    ('{"lr": [-1]}', "lr"),
    ('{"betas": [0.9]}', "betas"),
    ('{"betas": [0.9, 0.99, 0.999]}', "betas"),
    ('{"betas": [0.9, 1.5]}', "beta"),
    ('{"lr": 1' + "0" * 400 + "}", "lr"),
    ('{"eps": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper"),
    ('{"amsgrad": "yes"}', "amsgrad"),
    ('{"capturable": true}', "capturable"),
    ('{"lr": NaN}', "lr"),
    ('{"weight_decay": {"a": 1}}', "weight_decay"),
    ('{"frobnicate": 1}', "frobnicate"),
    ('[1, 2]', "not a JSON object"),
]


@pytest.mark.parametrize("options, named", BAD_OPTIONS)
def test_malformed_optimizer_options_are_invalid_argument_naming_the_field(stub, options, named):
    code, details = refusal(lambda: init(stub, "b", options))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert named in details
    assert not stub.Stats(ps_pb2.StatsRequest(), timeout=10).blocks  # nothing was created


BAD_HYPERS = [
    ('{"lr": [-1]}', "'lr'"),
    ('{"lr": -0.5}', "negative"),
    ('{"betas": [0.9]}', "'betas'"),
    ('{"betas": [0.9, 0.99, 0.999]}', "'betas'"),
    ('{"betas": [0.9, 1.5]}', "beta"),
    ('{"amsgrad": true}', "'amsgrad' is a flag"),
    ('{"lr": 1' + "0" * 400 + "}", "'lr'"),
    ('{"lr": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper"),
    ('{"lr": ' + "[" * 100000 + "]" * 100000 + "}", "characters of JSON"),
    ('{"lr": Infinity}', "'lr'"),
    ('{"lr": true}', "'lr'"),
    ('{"momentum": 0.9}', "'momentum' is not one of"),
    ('"lr"', "not a JSON object"),
]


@pytest.mark.parametrize("hypers, named", BAD_HYPERS)
def test_malformed_hyperparameters_are_refused_before_the_round_counts_them(stub, hypers, named):
    """Every worker of the block sends them (workers=1): agreed, they would be counted, and the step would raise
    and leave the block stuck; refused, the block steps the next honest push as if nothing had come."""
    init(stub, "b", '{"lr": 0.1}')
    code, details = refusal(lambda: stub.Push(iter(push_messages("b", hypers=hypers)), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert named in details
    stats = stub.Stats(ps_pb2.StatsRequest(), timeout=10)
    assert (stats.blocks[0].round, stats.blocks[0].pushed, stats.rounds_completed) == (0, 0, 0)
    assert not params(stub, "b").any()
    reply = stub.Push(iter(push_messages("b", hypers='{"lr": 0.05, "betas": [0.8, 0.9]}')), timeout=10)
    assert reply.results[0].pushed == 1
    chunks = list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0), timeout=10))
    assert chunks[0].meta.round == 1
    assert np.allclose(params(stub, "b"), -0.05)  # Adam's first step moves each element by lr


@pytest.mark.timeout(120)
def test_pushes_racing_to_take_over_a_silent_row_never_answer_internal(stub):
    """Each worker's row is held by a stream that sent a header and half its data, then nothing; four retries of
    every row wait behind it (the most a row admits) and all supersede the holder at once. Before, a retry whose
    holder another retry had just timed out got INTERNAL ("Cannot change state of expiring Timeout")."""
    workers = 12
    init(stub, "b", '{"lr": 0.1}', name="sgd", workers=workers)
    release = concurrent.futures.Future()

    def silent(worker: int):
        yield push_messages("b", worker)[0]
        yield ps_pb2.PushChunk(data=floats(np.ones(NUMEL // 2)))
        release.result(60)

    def outcome(call) -> str:
        try:
            call()
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    with concurrent.futures.ThreadPoolExecutor(workers * 5) as pool:
        holders = [pool.submit(outcome, lambda w=w: stub.Push(silent(w), timeout=30)) for w in range(workers)]
        time.sleep(0.5)
        retries = [pool.submit(outcome, lambda w=w: stub.Push(iter(push_messages("b", w, value=w)), timeout=30))
                   for w in range(workers) for _ in range(4)]
        answers = [f.result(60) for f in retries]
        release.set_result(None)
        held = [f.result(60) for f in holders]
    assert "INTERNAL" not in answers + held, (answers, held)
    assert set(held) == {"ABORTED"}
    assert answers.count("OK") == len(answers)  # the first retry counts, the others are acknowledged duplicates
    chunks = list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0), timeout=10))
    assert chunks[0].meta.round == 1
    assert np.allclose(params(stub, "b"), -0.1 * np.mean(range(workers)), atol=1e-6)



def test_a_holder_superseded_twice_in_consecutive_loop_turns_ends_with_superseded():
    """The race above, made deterministic: the first waiter's supersede expires the holder's idle timeout; the
    second comes in the next loop turn, after the timeout fired and before the holder's task ran. Before, that
    second supersede raised RuntimeError in the waiter (answered INTERNAL)."""
    from imerge.core.errors import Superseded
    from imerge.ps.streams import Progressing

    async def never():
        await asyncio.Event().wait()
        yield None

    async def scenario() -> BaseException | None:
        stream = Progressing(never(), idle_s=30, what="Push")
        holder = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)  # the holder waits inside its timeout
        stream.supersede("a newer push waited")
        await asyncio.sleep(0)  # the timeout fires in this turn; the holder's task runs in the next
        stream.supersede("another newer push waited")
        return await asyncio.gather(holder, return_exceptions=True)

    (outcome,) = asyncio.run(scenario())
    assert isinstance(outcome, Superseded) and "a newer push waited" in str(outcome)


@pytest.mark.timeout(240)
def test_a_client_pushing_as_every_worker_makes_the_job_fail_naming_it_or_changes_nothing(cluster):
    """Without worker identity, a client polls the shards and pushes zeros as every worker for each block's current
    round. Where it comes first its push is counted, and the real worker's push of that row is a second writer:
    refused, and the job fails within 30 s naming it. Before, the real pushes were acknowledged as duplicates and
    dropped: the job ended with a different model and no error."""
    import test_equivalence as eq

    data = eq.batches()
    c = cluster(eq.WORKERS, eq.SHARDS)
    stop, counted = threading.Event(), []

    def attack() -> None:
        stubs = [ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address)) for address in c.addresses]
        while not stop.is_set():
            for stub in stubs:
                with contextlib.suppress(grpc.RpcError):
                    for block in stub.Stats(ps_pb2.StatsRequest(), timeout=5).blocks:
                        for worker in range(block.num_workers):
                            header = ps_pb2.PushHeader(block_id=block.block_id, worker=worker, round=block.round,
                                                       dtype=ps_pb2.FLOAT32, numel=block.numel)
                            with contextlib.suppress(grpc.RpcError):
                                reply = stub.Push(iter([ps_pb2.PushChunk(header=header), ps_pb2.PushChunk(
                                    data=bytes(4 * block.numel))]), timeout=5)
                                if not reply.results[0].duplicate:
                                    counted.append((block.block_id, worker, block.round))
            time.sleep(0.001)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    started = time.monotonic()
    failure = None
    try:
        eq.distributed_run(c, eq.OPTIMIZERS["sgd"], data)
    except Exception as exc:  # noqa: BLE001 - what the job said
        failure = exc
    finally:
        stop.set()
        attacker.join(30)
    assert counted, "the attack never came first: the test proves nothing"
    assert failure is not None, "rows the attacker filled were trained on, silently"
    assert "two clients push as worker" in str(failure), repr(failure)
    assert time.monotonic() - started < 30
