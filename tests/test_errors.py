"""Errors keep their type across the wire, and a fatal one ends the job at once, with no recovery."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from imerge.core.errors import (FailedPrecondition, FutureGeneration, InvalidArgument, ProtocolError, RequestError,
                                StaleGeneration, Unavailable)
from imerge.core.optim import OptimizerSpec
from imerge.ops.redis_server import free_port
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.worker.config import WorkerConfig
from imerge.wire.status import error_from
from imerge.worker.items import PushItem
from imerge.worker.transport import ShardClient

IMERGE = [sys.executable, "-m", "imerge"]
NUMEL = 16


def call(coro):
    return asyncio.run(coro)


async def push(address: str, grad: torch.Tensor, round_: int = 0, generation: int = 0) -> None:
    client = ShardClient(address, WorkerConfig())
    try:
        await client.push([PushItem("b0", grad, round_)], 0, 5.0, generation)
    finally:
        await client.close()


@pytest.fixture
def shard():
    served = ThreadedShard(PSConfig(register=False, shard_index=0, metrics_port=-1))

    async def init() -> None:
        client = ShardClient(served.address, WorkerConfig())
        await client.init_block("b0", 2, OptimizerSpec(), torch.zeros(NUMEL), 5.0)
        await client.close()

    call(init())
    yield served
    served.stop()


def test_each_refusal_comes_back_as_its_class_naming_the_shard(shard):
    ones = torch.ones(NUMEL)
    cases = [  # (what the push does wrong, the class, recoverable)
        (dict(grad=torch.full((NUMEL,), float("nan"))), InvalidArgument, False),
        (dict(grad=ones, round_=5), FailedPrecondition, False),
        (dict(grad=ones, generation=1), FutureGeneration, True),
    ]
    for wrong, cls, recoverable in cases:
        with pytest.raises(cls) as info:
            call(push(shard.address, **{"grad": ones, **wrong}))
        assert type(info.value) is cls and info.value.recoverable is recoverable
        assert info.value.address == shard.address and str(info.value).startswith(shard.address)
    assert isinstance(info.value, FutureGeneration)
    shard.shard.generation = 2  # the job recovered twice without this caller
    with pytest.raises(StaleGeneration, match="generation 1 is stale") as info:
        call(push(shard.address, ones, generation=1))
    assert info.value.recoverable and info.value.status == "ABORTED"
    assert not issubclass(StaleGeneration, ProtocolError) and issubclass(FailedPrecondition, ProtocolError)


def test_a_push_refused_while_the_client_still_writes_answers_the_refusal(shard):
    """The shard refuses the first block (NaN) of streams whose second block, 16 MB, is still being written, four
    at once: each client reads the refusal, not gRPC's INTERNAL "Internal error from Core" of a broken write
    (without the shard reading the rest of a refused stream, 34 of 40 such pushes came back INTERNAL)."""
    big, streams = 1 << 22, 4

    async def refused() -> list[BaseException]:
        client = ShardClient(shard.address, WorkerConfig())
        try:
            for i in range(streams):
                await client.init_block(f"big{i}", 2, OptimizerSpec(), torch.zeros(big), 30.0)

            async def push_one(i: int) -> None:
                await client.push([PushItem("b0", torch.full((NUMEL,), float("nan")), 0),
                                   PushItem(f"big{i}", torch.ones(big), 0)], 0, 30.0)

            errors = []
            for _ in range(3):
                errors += await asyncio.gather(*(push_one(i) for i in range(streams)), return_exceptions=True)
            return errors
        finally:
            await client.close()

    errors = call(refused())
    assert [type(e).__name__ for e in errors] == ["InvalidArgument"] * len(errors), [str(e) for e in errors]
    assert all("gradient holds NaN or infinity" in str(e) for e in errors)
    assert not any(shard.shard.blocks[f"big{i}"].rounds.pushed for i in range(streams))


def test_an_unreachable_shard_is_recoverable():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable) as info:
        call(push(address, torch.ones(NUMEL)))
    assert info.value.recoverable and info.value.address == address


SCRIPT = """
import torch, imerge
from imerge.workloads.models import build_model
model = imerge.distribute(build_model("digits-cnn", 0), imerge.OptimizerSpec("sgd", lr=0.05))
x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
for step in range(30):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    (loss * (float("nan") if step == 3 else 1.0)).backward()   # one bad gradient: the shard refuses it
model.close()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("job", ["built-in", "script"])
def test_a_protocol_error_fails_the_job_at_once_with_no_recovery(tmp_path, job):
    """A push the shard refuses as malformed (a NaN gradient) ends the job with that message: no recovery is
    started, no role is restarted, whether the workers run the built-in job or a user's script."""
    if job == "built-in":  # a learning rate that overflows the parameters: the next gradients are NaN
        command = ["--model", "digits-cnn", "--data", "digits", "--iters", "40", "--lr", "1e38"]
    else:
        (tmp_path / "train.py").write_text(SCRIPT)
        command = ["--", sys.executable, str(tmp_path / "train.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
    started = time.monotonic()
    run = subprocess.run(IMERGE + ["launch", "--shards", "1", "--workers", "2", "--log-dir", str(tmp_path / "logs"),
                                   "--max-restarts", "2", *command],
                         env=env, capture_output=True, text=True, timeout=150)
    elapsed = time.monotonic() - started
    output = " ".join((run.stdout + run.stderr).split())  # the console wraps long lines
    logs = {path.stem: path.read_text() for path in Path(tmp_path / "logs").glob("*.log")}
    assert run.returncode == 1, output
    assert "gradient holds NaN or infinity" in output, output
    assert "restarting it" not in output  # no role was restarted
    # the coordinator took it as fatal, or the worker's exit code for a fatal error reached the launcher first
    # (the worker's script raised it before the coordinator read the worker's report; the job then ended at once)
    assert "a fatal error: a recovery would only repeat it" in logs["coordinator"] or \
        "failed with a fatal error (exit code 76: not restarted)" in output, (output, logs["coordinator"])
    assert "starting generation" not in logs["coordinator"]  # zero recoveries
    assert "moved to generation" not in logs["ps0"] and "restore" not in logs["ps0"]  # the shard restored nothing
    assert elapsed < 90, f"the job took {elapsed:.0f}s to fail"


class Refusal(grpc.RpcError):
    """What a gRPC call raises, as a value: a status code, its details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, metadata: tuple = ()):
        self._code, self._metadata = code, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple:
        return self._metadata


@pytest.mark.parametrize("code, metadata, cls", [
    (grpc.StatusCode.ABORTED, (("imerge-error", "StaleGeneration"),), StaleGeneration),
    (grpc.StatusCode.FAILED_PRECONDITION, (), FailedPrecondition),          # no class named: by the status code
    (grpc.StatusCode.FAILED_PRECONDITION, (("imerge-error", "Exploit"),), FailedPrecondition),  # unknown name
    (grpc.StatusCode.INVALID_ARGUMENT, (("imerge-error", "StaleGeneration"),), InvalidArgument),  # code disagrees
    (grpc.StatusCode.FAILED_PRECONDITION, (("imerge-error", "StaleGeneration"),), FailedPrecondition),
    (grpc.StatusCode.UNAVAILABLE, (), Unavailable),
    (grpc.StatusCode.DATA_LOSS, (), RequestError),
])
def test_a_status_maps_to_a_class_only_where_name_and_code_agree(code, metadata, cls):
    error = error_from(Refusal(code, metadata), "ps0:50051")
    assert type(error) is cls and error.address == "ps0:50051" and str(error) == "ps0:50051: refused"


def test_without_the_trailer_each_status_code_still_decides_recoverable_or_fatal():
    """A proxy that drops trailing metadata leaves the client only the status code: every class still comes back
    as one that is recoverable exactly when it is (before, a stale generation came back as a fatal
    FailedPrecondition, and ABORTED and ALREADY_EXISTS had no class at all)."""
    from imerge.core.errors import request_error_classes
    from imerge.wire.status import status_of

    for name, cls in request_error_classes().items():
        if cls.status == "UNKNOWN":  # the bases: never raised by a shard
            continue
        code, trailers = status_of(cls("refused"))
        with_trailer, without = error_from(Refusal(code, trailers), "s:1"), error_from(Refusal(code, ()), "s:1")
        assert type(with_trailer) is cls
        assert without.recoverable == cls.recoverable, (name, code, type(without).__name__)
        assert type(without).status == cls.status, name
