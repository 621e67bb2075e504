"""Fuzzing: thousands of generated malformed messages against each RPC of a real shard process.

Options and hyperparameters of every kind, length, magnitude and nesting; fencing tokens, lanes, generations,
loss scales and max norms; Export, Import and OpenChannel as well as the data RPCs (the data channel's frames are
fuzzed in ``test_datachannel.py``). Every answer must carry a documented status code (bytes that are not the method's message get
INVALID_ARGUMENT too; never INTERNAL or UNKNOWN, never a crash); afterwards the shard still serves, its memory grew less than 50 MB, and it holds no more
threads or file descriptors than before.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imerge.ops.redis_server import free_port
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

# Examples per RPC: 600 in the suite (about 18 s); IMERGE_FUZZ_EXAMPLES=10000 for the full run.
EXAMPLES = int(os.environ.get("IMERGE_FUZZ_EXAMPLES", "600"))  # more: IMERGE_FUZZ_EXAMPLES (the suite's time)
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.ABORTED,             # a push fenced by a newer token another fuzzed push brought
              grpc.StatusCode.UNAVAILABLE,         # a generation the shard has not restored
              grpc.StatusCode.RESOURCE_EXHAUSTED}  # bounds on what one client may hold
BLOCK, NUMEL, WORKERS = "fuzz-block", 64, 2
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

ids = st.one_of(st.just(BLOCK), st.text(max_size=12), st.just(""), st.text(min_size=200, max_size=300))
u32 = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1))
dtypes = st.integers(0, 2**31 - 1)
payload = st.one_of(st.binary(max_size=64), st.just(np.ones(NUMEL, "<f4").tobytes()),
                    st.just(np.full(NUMEL, np.nan, "<f4").tobytes()))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-2**70, 2**70),
                                      st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=6)
hostile_json = st.one_of(  # kinds, lengths, magnitudes, flags and nesting a client may send as options or hypers
    st.dictionaries(st.sampled_from(["lr", "momentum", "betas", "amsgrad", "nesterov", "maximize", "eps",
                                     "weight_decay", "dampening", "capturable", "differentiable", "foreach",
                                     "fused", "x"]), json_values, max_size=3).map(json.dumps),
    st.integers(1, 6000).map(lambda depth: '{"lr": ' + "[" * depth + "]" * depth + "}"),
    st.just('{"lr": 1' + "0" * 400 + "}"), st.just('{"lr": NaN}'), st.just('{"lr": -Infinity}'))
optimizer_options = st.one_of(
    hostile_json,
    st.text(max_size=40),
    st.fixed_dictionaries({}, optional={"lr": st.floats(allow_nan=True, allow_infinity=True),
                                        "momentum": st.floats(-2, 2), "weight_decay": st.floats(allow_nan=True),
                                        "betas": st.lists(st.floats(-1, 2), max_size=3),
                                        "eps": st.floats(allow_nan=True), "groups": st.just([]),
                                        "foreach": st.one_of(st.none(), st.booleans(), st.text(max_size=3))}
                            ).map(json.dumps))
optimizers = st.builds(ps_pb2.OptimizerSpec, name=st.sampled_from(["sgd", "adam", "adamw", "", "rmsprop", "lbfgs",
                                                                   "x" * 50]),
                       options_json=optimizer_options)
specs = st.builds(ps_pb2.BlockSpec, block_id=ids, dtype=dtypes, numel=u64, num_workers=u32, optimizer=optimizers,
                  segments=st.lists(u64, max_size=3))
floats = st.floats(allow_nan=True, allow_infinity=True)
headers = st.builds(ps_pb2.PushHeader, block_id=ids, worker=u32, round=u64, dtype=dtypes, numel=u64,
                    hypers=st.one_of(st.just(""), st.text(max_size=20), st.just('{"lr": 0.5}'),
                                     st.just('{"lr": "x"}'), st.just('{"nope": 1}'), hostile_json),
                    no_grad=st.lists(u32, max_size=3), generation=st.one_of(st.just(0), u64), fence=u64,
                    lane=u32, assign=st.booleans(), loss_scale=floats, max_norm=floats)
init_parts = st.one_of(st.builds(ps_pb2.InitBlockChunk, spec=specs), st.builds(ps_pb2.InitBlockChunk, data=payload))
push_parts = st.one_of(st.builds(ps_pb2.PushChunk, header=headers), st.builds(ps_pb2.PushChunk, data=payload))
pulls = st.builds(ps_pb2.PullRequest, block_ids=st.lists(ids, max_size=4), worker=u32, round=u64,
                  timeout_s=st.floats(0.001, 0.02))
fetches = st.builds(ps_pb2.FetchRequest, block_ids=st.lists(ids, max_size=4))
exports = st.builds(ps_pb2.ExportRequest, block_ids=st.lists(ids, max_size=4), generation=st.one_of(st.just(0), u64))
import_parts = st.one_of(st.builds(ps_pb2.BlockStateChunk, meta=st.builds(
    ps_pb2.BlockStateMeta, block_id=ids, nbytes=u64, generation=st.one_of(st.just(0), u64))),
    st.builds(ps_pb2.BlockStateChunk, data=st.one_of(payload, st.binary(min_size=8, max_size=200))))
channels = st.builds(ps_pb2.ChannelRequest, worker=u32, generation=st.one_of(st.just(0), u64))
garbage = st.binary(max_size=200)


def process_figures(pid: int) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


@pytest.fixture(scope="module")
def shard():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "imerge", "ps", "--no-register", "--host", "127.0.0.1",
                                "--port", str(port), "--metrics-port", "-1", "--log-level", "ERROR"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    spec = ps_pb2.BlockSpec(block_id=BLOCK, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS,
                            optimizer=ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}'))
    stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                         ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]))
    yield process, channel, stub
    channel.close()
    process.terminate()
    assert process.wait(30) in (0, -15), process.stderr.read().decode()[-3000:]


def answer(call, allowed=DOCUMENTED) -> None:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)
    except grpc.RpcError as exc:
        assert exc.code() in allowed, f"{exc.code().name}: {exc.details()}"


@pytest.mark.timeout(900)
def test_fuzz_every_rpc(shard):
    process, channel, stub = shard
    steady = process_figures(process.pid)

    @FUZZ
    @given(st.lists(init_parts, max_size=4))
    def init_block(parts):
        answer(lambda: stub.InitBlock(iter(parts), timeout=5))

    @FUZZ
    @given(st.lists(push_parts, max_size=5))
    def push(parts):
        answer(lambda: stub.Push(iter(parts), timeout=5))

    @FUZZ
    @given(pulls)
    def pull(request):
        answer(lambda: stub.Pull(request, timeout=5))

    @FUZZ
    @given(fetches)
    def fetch(request):
        answer(lambda: stub.Fetch(request, timeout=5))

    @FUZZ
    @given(exports)
    def export(request):
        answer(lambda: stub.Export(request, timeout=5))

    @FUZZ
    @given(st.lists(import_parts, max_size=4))
    def import_(parts):
        answer(lambda: stub.Import(iter(parts), timeout=5))

    @FUZZ
    @given(channels)
    def open_channel(request):
        answer(lambda: stub.OpenChannel(request, timeout=5))

    streaming = ("InitBlock", "Push", "Import")
    raw = {name: channel.unary_unary(f"/imerge.v1.ParameterServer/{name}", request_serializer=None,
                                     response_deserializer=None)
           for name in ("Stats", "Pull", "Fetch", "Export", "OpenChannel")}
    raw |= {name: channel.stream_unary(f"/imerge.v1.ParameterServer/{name}", request_serializer=None,
                                       response_deserializer=None) for name in streaming}

    @FUZZ
    @given(st.sampled_from(sorted(raw)), garbage)
    def undecodable(name, data):
        request = iter([data]) if name in streaming else data
        answer(lambda: raw[name](request, timeout=5))

    for fuzz in (init_block, push, pull, fetch, export, import_, open_channel, undecodable):
        fuzz()
    assert process.poll() is None, "the shard died: " + process.stderr.read().decode()[-3000:]
    stats = stub.Stats(ps_pb2.StatsRequest(), timeout=10)
    assert stats.rejected > 0 and any(b.block_id == BLOCK for b in stats.blocks)
    after = process_figures(process.pid)
    assert after["rss_kib"] - steady["rss_kib"] < 50 * 1024, (steady, after)
    assert after["threads"] <= steady["threads"] + 2 and after["fds"] <= steady["fds"] + 4, (steady, after)
