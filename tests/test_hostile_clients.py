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
import re
import threading
import time

import grpc
import numpy as np
import pytest

from helpers import status_of
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


def init(stub, block_id: str, options_json: str, name: str = "adam", workers: int = 1, numel: int = NUMEL):
    spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=numel, num_workers=workers,
                            optimizer=ps_pb2.OptimizerSpec(name=name, options_json=options_json))
    data = [ps_pb2.InitBlockChunk(data=floats(np.zeros(min(numel - start, 1 << 18))))
            for start in range(0, numel, 1 << 18)]
    return stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec), *data]), timeout=30)


def push_messages(block_id: str, worker: int = 0, round_: int = 0, value: float = 1.0, **header):
    return [ps_pb2.PushChunk(header=ps_pb2.PushHeader(block_id=block_id, worker=worker, round=round_,
                                                      dtype=ps_pb2.FLOAT32, numel=NUMEL, **header)),
            ps_pb2.PushChunk(data=floats(np.full(NUMEL, value)))]


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
    code, details = status_of(lambda: init(stub, "b", options))
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
    code, details = status_of(lambda: stub.Push(iter(push_messages("b", hypers=hypers)), timeout=10))
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

    def body(rank: int) -> None:
        eq.distributed_run(OneWorker(c, rank), eq.OPTIMIZERS["sgd"], data)

    try:
        with concurrent.futures.ThreadPoolExecutor(eq.WORKERS) as pool:
            outcomes = [future.exception(120) for future in [pool.submit(body, rank) for rank in range(eq.WORKERS)]]
    finally:
        stop.set()
        attacker.join(30)
    assert counted, "the attack never came first: the test proves nothing"
    failures = [str(outcome) for outcome in outcomes if outcome is not None]
    assert failures, "rows the attacker filled were trained on, silently"
    # the worker whose push was refused names the cause; the others may fail first on its leaving; a worker that
    # joined after the attacker completed some of a group's rounds finds the group uneven and says why
    named = any("two clients push as worker" in failure or "another client pushes as a worker" in failure
                for failure in failures)
    # or the attacker completed whole rounds of a block before any worker pushed to it (a loaded machine): the
    # workers' calls for those rounds are refused as behind the block, and the counted pushes show whose rows
    # completed them
    behind = [match.groups() for failure in failures for match in re.finditer(
        r"of block (\S+) by worker \d+ for round (\d+): the block's current round is \d+", failure)]
    rows_counted = set(counted)
    completed_by_attacker = behind and all({(block, w, int(round_)) for w in range(eq.WORKERS)} <= rows_counted
                                           for block, round_ in behind)
    assert named or completed_by_attacker, (failures, counted)
    assert time.monotonic() - started < 30


class OneWorker:
    """A cluster as test_equivalence.distributed_run sees it, running only ``rank`` (in the calling thread)."""

    def __init__(self, cluster, rank: int):
        self.cluster, self.rank = cluster, rank

    def worker_config(self, rank: int, **options):
        # the schedule as given: a worker waiting at the --tune plan switch for a profile that never comes waits
        # up to its wait timeout (a known limit), which is not what this test bounds
        options.setdefault("tune", "none")
        return self.cluster.worker_config(rank, **options)

    def run_workers(self, body):
        return [body(self.rank)]


def export(stub, block_id: str) -> bytes:
    chunks = list(stub.Export(ps_pb2.ExportRequest(block_ids=[block_id]), timeout=10))
    return b"".join(c.data for c in chunks if c.WhichOneof("part") == "data")


def state_chunks(block_id: str, data: bytes, nbytes: int | None = None):
    yield ps_pb2.BlockStateChunk(meta=ps_pb2.BlockStateMeta(block_id=block_id, nbytes=len(data) if nbytes is None
                                                            else nbytes))
    for start in range(0, len(data), 1 << 20):
        yield ps_pb2.BlockStateChunk(data=data[start:start + (1 << 20)])


def safetensors_of(tensors: dict, metadata: dict | None = None) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


def test_an_import_is_bounded_by_its_block_and_checked_whole_before_anything_is_applied(stub):
    """Before, an Import collected whatever it declared (up to 4 GiB) before it looked the block up, accepted an
    empty stream, a 2-D parameter, metadata and state the optimizer does not keep, and applied each block as it
    completed: a bad second block left the first one changed."""
    import torch

    init(stub, "a", '{"lr": 0.1}')
    init(stub, "b", '{"lr": 0.1}')
    for block in ("a", "b"):  # a step: Adam's state exists
        stub.Push(iter(push_messages(block)), timeout=10)
        list(stub.Pull(ps_pb2.PullRequest(block_ids=[block], worker=0, round=0), timeout=10))
    before = {block: export(stub, block) for block in ("a", "b")}
    flat = torch.full((NUMEL,), 3.0)
    moments = {"state/0/exp_avg": torch.zeros(NUMEL), "state/0/exp_avg_sq": torch.zeros(NUMEL),
               "state/0/step": torch.tensor(1.0)}
    good = safetensors_of({"param": flat, **moments})
    cases = {
        "declares 1 GiB": (lambda: stub.Import(state_chunks("a", b"x" * 16, 1 << 30), timeout=10),
                           "more than its state can take"),
        "unknown block": (lambda: stub.Import(state_chunks("nope", b"x" * 16, 1 << 30), timeout=10), "'nope'"),
        "empty stream": (lambda: stub.Import(iter([]), timeout=10), "empty stream"),
        "2-D parameter": (lambda: stub.Import(state_chunks("a", safetensors_of(
            {"param": flat.reshape(8, 8), **moments})), timeout=10), "flat tensor"),
        "metadata": (lambda: stub.Import(state_chunks("a", safetensors_of(
            {"param": flat, **moments}, {"x": "y" * 1000})), timeout=10), "__metadata__"),
        "foreign state": (lambda: stub.Import(state_chunks("a", safetensors_of(
            {"param": flat, "state/0/momentum_buffer": torch.zeros(NUMEL)})), timeout=10), "momentum_buffer"),
        "half the state": (lambda: stub.Import(state_chunks("a", safetensors_of(
            {"param": flat, "state/0/exp_avg": torch.zeros(NUMEL)})), timeout=10), "not all of"),
        "a bad second block": (lambda: stub.Import(iter([*state_chunks("a", good), *state_chunks(
            "b", good[:-8])]), timeout=10), "block b"),
        "a block twice": (lambda: stub.Import(iter([*state_chunks("a", good), *state_chunks("a", good)]),
                                              timeout=10), "named twice"),
    }
    for case, (call, named) in cases.items():
        code, details = status_of(call)
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (case, code, details)
        assert named in details, (case, details)
        assert {block: export(stub, block) for block in ("a", "b")} == before, f"{case} changed a block"
    assert list(stub.Import(state_chunks("a", good), timeout=10).block_ids) == ["a"]
    assert np.array_equal(params(stub, "a"), np.full(NUMEL, 3.0, "<f4"))


@pytest.mark.timeout(60)
def test_unread_exports_and_parked_pulls_are_bounded(redis_url):
    """Each Export a client does not read holds the block state it is sending: at most four at once. A pull's
    wait is cut to --max-pull-timeout-s whatever it asks for, and one connection parks at most 256 block waits
    (16 per block the shard holds, at least 256)."""
    shard = ThreadedShard(PSConfig(redis_url=redis_url, job="hostile", register=False, pull_timeout_s=1.0,
                                   max_pull_timeout_s=2.0))
    try:
        with grpc.insecure_channel(shard.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            init(stub, "b", '{"lr": 0.1}', workers=2, numel=1 << 22)  # 16 MiB: more than gRPC's windows hold
            unread = [stub.Export(ps_pb2.ExportRequest(block_ids=["b"]), timeout=30) for _ in range(4)]
            for call in unread:
                next(call)  # under way, the rest not read
            code, details = status_of(lambda: stub.Export(ps_pb2.ExportRequest(block_ids=["b"]), timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4" in details
            for call in unread:
                call.cancel()
            time.sleep(0.2)
            assert export(stub, "b")  # the slots came back

            started = time.monotonic()
            code, details = status_of(lambda: list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0,
                                                                              timeout_s=1e9), timeout=30)))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "timed out after 2s" in details
            assert time.monotonic() - started < 5
            parked = [stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0, timeout_s=30), timeout=30)
                      for _ in range(256)]
            deadline = time.monotonic() + 20
            while True:  # until the shard has parked all of them, then one more is refused
                try:
                    list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0, timeout_s=0.2),
                                   timeout=10))
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert "at most 256" in exc.details()
                        break
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() < deadline, "a 257th parked pull was never refused"
            for call in parked:
                call.cancel()
    finally:
        shard.stop()


@pytest.mark.timeout(120)
def test_an_import_outside_imerge_load_is_refused_and_changes_nothing(cluster):
    """A shard of a job accepts an Import only while worker 0 runs imerge.load, which announces it in the store.
    Before, any client could Export, edit and Import the job's model between two rounds, and it trained on."""
    import torch

    import imerge
    from imerge.core.optim import OptimizerSpec

    c = cluster(1, 1)
    model = imerge.distribute(torch.nn.Linear(4, 2), OptimizerSpec("sgd", lr=0.1), c.worker_config(0))
    try:
        model(torch.ones(3, 4)).sum().backward()
        model.synchronize()
        with grpc.insecure_channel(c.addresses[0]) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            block = stub.Stats(ps_pb2.StatsRequest(), timeout=10).blocks[0].block_id
            state = export(stub, block)
            code, details = status_of(lambda: stub.Import(state_chunks(block, state), timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "no imerge.load" in details
            assert export(stub, block) == state
    finally:
        model.close()


@pytest.mark.timeout(120)
def test_a_fencing_token_ahead_of_the_stores_clock_is_refused_and_adopted_nowhere(cluster):
    """Slot-flag tokens are Redis' clock at the grant, so none is ahead of it. A push carrying 2^64-1 is refused
    before anything is received, and the block's fence stays where it was: the job trains on. Before, the token
    was adopted and every honest push after it was fenced off."""
    import torch

    import imerge
    from imerge.core.optim import OptimizerSpec

    from helpers import raw_push

    c = cluster(1, 1)
    model = imerge.distribute(torch.nn.Linear(4, 2), OptimizerSpec("sgd", lr=0.1), c.worker_config(0))
    try:
        model(torch.ones(3, 4)).sum().backward()
        model.synchronize()
        (block,) = c.shards[0].shard.blocks.values()
        fence, round_ = dict(block.rounds.fence), block.round
        code, details = raw_push(c.addresses[0], block.meta.block_id, block.meta.numel, 0, round_, 0, 2 ** 64 - 1)
        assert code == "INVALID_ARGUMENT" and "ahead of the store's clock" in details
        assert (block.rounds.fence, block.round, block.rounds.pushed) == (fence, round_, set())
        model(torch.ones(3, 4)).sum().backward()
        model.synchronize()
        assert block.round == round_ + 1
    finally:
        model.close()


@pytest.fixture
def served(redis_url):
    shard = ThreadedShard(PSConfig(redis_url=redis_url, job="hostile", register=False, pull_timeout_s=2.0))
    with grpc.insecure_channel(shard.address) as channel:
        yield shard.shard, ps_pb2_grpc.ParameterServerStub(channel)
    shard.stop()


def test_every_refused_push_leaves_the_block_as_it_was(served):
    """Worker 0's push of round 0 is counted (fence 5 in lane 0); then every way a push is refused. After each:
    the round, the counted workers, the fences, worker 0's row, the parameters, the optimizer state and every
    counter but the refusal counters are what they were. (An uncounted row is scratch space: a refused push
    may have written part of it, and the worker's next push overwrites it whole.)"""
    shard, stub = served
    init(stub, "b", '{"lr": 0.1, "momentum": 0.9}', name="sgd", workers=2)
    stub.Push(iter(push_messages("b", 0, fence=5)), timeout=10)
    block = shard.blocks["b"]

    def state():
        c = shard.counters
        return (block.round, set(block.rounds.pushed), dict(block.rounds.fence), list(block.rounds.sources),
                block.grads[0].numpy().tobytes(), block.flat.numpy().tobytes(), repr(block.optimizer.state_dict()),
                c.pushes, c.duplicate_pushes, c.bytes_received, c.rounds_completed)

    def header_then(data: bytes, **header):
        fields = {"block_id": "b", "worker": 1, "round": 0, "dtype": ps_pb2.FLOAT32, "numel": NUMEL, **header}
        return iter([ps_pb2.PushChunk(header=ps_pb2.PushHeader(**fields)), ps_pb2.PushChunk(data=data)])

    ones = floats(np.ones(NUMEL))
    refusals = {
        "unknown block": (header_then(ones, block_id="nope"), "NOT_FOUND"),
        "worker out of range": (header_then(ones, worker=7), "INVALID_ARGUMENT"),
        "wrong size": (header_then(ones, numel=NUMEL + 1), "INVALID_ARGUMENT"),
        "wrong encoding": (header_then(ones, dtype=ps_pb2.FLOAT16), "INVALID_ARGUMENT"),
        "future generation": (header_then(ones, generation=3), "UNAVAILABLE"),
        "another round": (header_then(ones, round=5), "FAILED_PRECONDITION"),
        "malformed hypers": (header_then(ones, hypers='{"lr": [1]}'), "INVALID_ARGUMENT"),
        "flag changed": (header_then(ones, hypers='{"nesterov": true}'), "INVALID_ARGUMENT"),
        "NaN loss scale": (header_then(ones, loss_scale=float("nan")), "INVALID_ARGUMENT"),
        "options disagree": (header_then(ones, assign=True), "FAILED_PRECONDITION"),
        "older fence": (header_then(ones, fence=3), "ABORTED"),
        "NaN gradient, newest fence": (header_then(floats(np.full(NUMEL, np.nan)), fence=2**64 - 1),
                                       "INVALID_ARGUMENT"),
        "truncated, newest fence": (header_then(ones[:100], fence=2**63), "INVALID_ARGUMENT"),
        "too long": (header_then(ones + ones), "INVALID_ARGUMENT"),
        "second writer": (header_then(floats(np.full(NUMEL, 9.0)), worker=0), "ALREADY_EXISTS"),
    }
    for case, (messages, code) in refusals.items():
        before = state()
        got, details = status_of(lambda: stub.Push(messages, timeout=10))
        assert got.name == code, (case, got, details)
        assert state() == before, f"{case} changed the block"
    assert stub.Push(iter(push_messages("b", 1, value=3.0, fence=6)), timeout=10).results[0].pushed == 2
    list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0), timeout=10))
    assert np.allclose(params(stub, "b"), -0.1 * 2.0)  # the mean of 1 and 3, one SGD step
