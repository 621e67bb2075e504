"""The data channel: what the gRPC data path promises holds on it too.

A real shard process (``imerge ps --no-register``) and raw sockets that send frames no worker would: each is
refused with an ERROR frame naming the error's class, before a byte of its payload is read, and applies nothing;
an idle connection is closed; a stalled push is superseded by the retry of its row; the channel is TLS (never
plaintext) when the shard serves TLS, with the worker identity of the client certificate enforced; the worker's
client (:class:`imerge.worker.transport.ShardClient` with ``data_path="socket"``) pushes and pulls bit-exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import struct
import threading
import time
import types
import weakref

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imerge.core.errors import AlreadyExists, Unavailable
from imerge.ps.checkpoint import CheckpointStore
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.wire.datapath import HEADER, MAGIC, Kind, read_exact, read_header, read_meta, send_frame
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc
from imerge.worker.items import PushItem
from imerge.worker.transport import ShardClient
from test_request_bounds import SGD, ShardProcess

NUMEL = 1000
WORKERS = 2


class Raw:
    """A raw data connection to a shard: frames as the test writes them."""

    def __init__(self, shard: ShardProcess, worker: int = 0, generation: int = 0, token: bytes | None = None,
                 hello: bool = True):
        reply = shard.stub.OpenChannel(ps_pb2.ChannelRequest(worker=worker, generation=generation), timeout=10)
        self.sock = socket.create_connection(("127.0.0.1", reply.port), timeout=10)
        if hello:
            send_frame(self.sock, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token if token is None else token,
                                                                  worker=worker, generation=generation))

    def answer(self, timeout_s: float = 10) -> tuple[Kind, object]:
        """The next frame's kind and meta (ERROR: (error class name, message))."""
        self.sock.settimeout(timeout_s)
        header = read_header(self.sock, 1 << 40, "test")
        meta_type = {Kind.ERROR: ps_pb2.ChannelError, Kind.RESULT: ps_pb2.BlockPushResult,
                     Kind.BLOCK: ps_pb2.TensorMeta}.get(header.kind)
        meta = read_meta(self.sock, header, meta_type, "test") if meta_type else None
        if header.kind == Kind.ERROR:
            return header.kind, (meta.error, meta.message)
        return header.kind, meta

    def closed(self, timeout_s: float = 10, shut: bool = True) -> bool:
        """Whether the shard closed the connection (reads reach the end). With ``shut`` the test's side is shut
        first (it has nothing more to send), so a shard draining what a refused call still writes sees the
        end at once."""
        self.sock.settimeout(timeout_s)
        if shut:
            with contextlib.suppress(OSError):  # the shard's reset came first
                self.sock.shutdown(socket.SHUT_WR)
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


BLOCK = "b"  # the block of the running test (each test makes its own on the module's shard)


def push_header(worker: int = 0, round_: int = 0, **fields) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(**{"block_id": BLOCK, "worker": worker, "round": round_, "dtype": ps_pb2.FLOAT32,
                                "numel": NUMEL, **fields})


def gradient(value: float) -> bytes:
    return np.full(NUMEL, value, "<f4").tobytes()


@pytest.fixture(scope="module", params=["native", "python"])
def shard_process(tmp_path_factory, request):
    """The module's shard, on each data plane (the C extension's receive, and Python's)."""
    process = ShardProcess(tmp_path_factory.mktemp("shard"), "--stream-idle-s", "2", "--data-plane", request.param)
    yield process
    process.stop()


@pytest.fixture
def shard(shard_process, request):
    """The module's shard, with a block of this test's own."""
    global BLOCK
    BLOCK = f"b-{request.node.name}"[:200]
    spec = ps_pb2.BlockSpec(block_id=BLOCK, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS, optimizer=SGD)
    shard_process.stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                                       ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
    return shard_process


def block_stats(shard: ShardProcess) -> ps_pb2.BlockStats:
    return next(b for b in shard.stub.Stats(ps_pb2.StatsRequest(), timeout=10).blocks if b.block_id == BLOCK)


def pushed(shard: ShardProcess) -> int:
    return block_stats(shard).pushed


def test_the_workers_client_pushes_and_pulls_on_the_channel_bit_exactly(shard):
    """Two workers push through ShardClient(data_path="socket"); the pull returns SGD's step of the mean."""
    grads = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(w)) for w in range(WORKERS)]
    before = shard.stub.Stats(ps_pb2.StatsRequest(), timeout=10)

    async def run(worker: int) -> torch.Tensor:
        client = ShardClient(shard.address, data_path="socket")
        target = torch.empty(NUMEL)
        try:
            reply = await client.push([PushItem(BLOCK, grads[worker], 0)], worker, timeout_s=10)
            assert not reply.results[0].duplicate
            arrived = []
            rounds = await client.pull_into([(BLOCK, target)], worker, 0, 10,
                                            on_block=lambda *block: arrived.append(block[:2]))
            assert rounds == [1] and arrived == [(BLOCK, 1)]
            again = await client.push([PushItem(BLOCK, grads[worker], 0)], worker, timeout_s=10)  # a retry: a duplicate
            assert again.results[0].duplicate
            with pytest.raises(AlreadyExists, match=f"data connection from 127.0.0.1:.*two clients push as worker "
                                                    f"{worker}"):  # other bytes: a second writer, refused
                await client.push([PushItem(BLOCK, grads[worker] + 1, 0)], worker, timeout_s=10)
        finally:
            await client.close()
        return target

    async def both():
        return await asyncio.gather(run(0), run(1))

    results = asyncio.run(both())
    mean = grads[0].clone().add_(grads[1]).div_(WORKERS)
    expected = torch.zeros(NUMEL).add_(mean, alpha=-0.1)
    for result in results:
        assert torch.equal(result, expected)
    after = shard.stub.Stats(ps_pb2.StatsRequest(), timeout=10)
    assert block_stats(shard).round == 1 and after.duplicate_pushes - before.duplicate_pushes == 2
    assert after.bytes_received - before.bytes_received == WORKERS * NUMEL * 4
    assert after.bytes_sent - before.bytes_sent == WORKERS * NUMEL * 4


def test_the_clients_threads_hold_no_payload_once_idle_and_are_ended_by_close(shard):
    """A thread of the client's pool that finished a push keeps no reference to its gradient (the tensor is freed
    when the caller drops it), and ``close`` returns only once every thread of the pool has ended: a thread still
    running when the interpreter finalizes aborts the process the moment it frees a tensor."""
    pool_threads = lambda: [t for t in threading.enumerate() if t.name == "imerge-data"]  # noqa: E731
    before = set(pool_threads())

    async def run() -> weakref.ref:
        client = ShardClient(shard.address, data_path="socket")
        try:
            memory = np.random.default_rng(0).standard_normal(NUMEL, dtype=np.float32)
            pushed_gradient = weakref.ref(memory)  # alive while any tensor or view on its memory is
            await client.push([PushItem(BLOCK, torch.from_numpy(memory), 0)], 0, timeout_s=10)
            del memory
            gc.collect()
            assert pushed_gradient() is None, "an idle thread of the pool keeps the pushed gradient's memory"
            assert set(pool_threads()) - before, "the push ran on no thread of the client's pool"
        finally:
            await client.close()
        return pushed_gradient

    asyncio.run(run())
    assert not set(pool_threads()) - before


def test_a_call_after_close_fails_at_once_and_starts_no_thread(shard):
    """A push or a pull that comes after the client closed (a model's exit hook racing the comm loop) is refused
    with Unavailable, saying so, instead of opening a connection or waiting on a thread that never runs it."""
    pool_threads = lambda: [t for t in threading.enumerate() if t.name == "imerge-data"]  # noqa: E731

    async def run() -> None:
        client = ShardClient(shard.address, data_path="socket")
        await client.push([PushItem(BLOCK, torch.zeros(NUMEL), 0)], 0, timeout_s=10)  # the pool has a connection
        await client.close()
        before = set(pool_threads())
        started = time.monotonic()
        with pytest.raises(Unavailable, match="closed"):
            await client.push([PushItem(BLOCK, torch.zeros(NUMEL), 1)], 0, timeout_s=10)
        with pytest.raises(Unavailable, match="closed"):
            await client.pull_into([(BLOCK, torch.empty(NUMEL))], 0, 0, 10)
        assert time.monotonic() - started < 2.0
        assert not set(pool_threads()) - before

    asyncio.run(run())


def test_a_connection_without_its_token_is_refused_at_the_hello(shard):
    raw = Raw(shard, worker=1, token=b"\0" * 16)
    assert raw.answer() == (Kind.ERROR, ("PermissionDenied", "data connection of worker 1: its token is not the one "
                                                             "OpenChannel gave worker 1 for generation 0"))
    assert raw.closed()
    stolen = shard.stub.OpenChannel(ps_pb2.ChannelRequest(worker=0), timeout=10).token
    other = Raw(shard, worker=1, token=stolen)  # worker 0's token does not open worker 1's connection
    assert other.answer()[1][0] == "PermissionDenied"


def test_a_hello_of_another_generation_is_refused(shard):
    with pytest.raises(Exception, match="generation 3"):
        Raw(shard, generation=3)  # OpenChannel itself refuses a generation the shard is not at
    reply = shard.stub.OpenChannel(ps_pb2.ChannelRequest(worker=0), timeout=10)
    sock = socket.create_connection(("127.0.0.1", reply.port), timeout=10)
    send_frame(sock, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token, worker=0, generation=3))
    header = read_header(sock, 0, "test")
    assert header.kind == Kind.ERROR
    error = read_meta(sock, header, ps_pb2.ChannelError, "test")
    assert error.error == "FutureGeneration" and "generation 3" in error.message


def test_the_first_frame_must_be_a_hello(shard):
    raw = Raw(shard, hello=False)
    send_frame(raw.sock, Kind.PUSH, push_header(), [gradient(1.0)])
    kind, (error, message) = raw.answer()
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and "HELLO" in message
    assert pushed(shard) == 0


REFUSALS = {  # the push's fields, the class that refuses it, and a phrase of the message; its payload is never sent
    "a block the shard does not hold": (dict(block_id="nope"), "NotFound", "not on shard"),
    "a numel that is not the block's": (dict(numel=NUMEL + 1), "InvalidArgument", f"got {NUMEL + 1} elements"),
    "another worker's row": (dict(worker=1), "PermissionDenied", "worker 0's data connection"),
    "a round that is not the block's": (dict(round_=5), "FailedPrecondition", "current round is 0"),
    "an unknown dtype": (dict(dtype=7), "InvalidArgument", "unsupported dtype 7"),
    "a generation that is not the connection's": (dict(generation=4), "InvalidArgument",
                                                  "of generation 4 on a data connection of generation 0"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_push_frame_is_checked_before_its_payload_is_read(shard, case):
    """Only the header and meta go out, declaring the block's payload: the ERROR comes without the payload."""
    fields, error, phrase = REFUSALS[case]
    raw = Raw(shard)
    assert raw.answer()[0] == Kind.WELCOME
    meta = push_header(**fields).SerializeToString()
    raw.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta)
    kind, (got, message) = raw.answer(timeout_s=5)
    assert (kind, got) == (Kind.ERROR, error) and phrase in message, message
    assert raw.closed() and pushed(shard) == 0


@pytest.mark.parametrize("case", ["bad magic", "unknown kind", "meta too long", "payload larger than any block",
                                  "payload on a pull", "meta not a PushHeader", "length not the block's"])
def test_a_malformed_frame_closes_the_channel_with_a_clear_error_and_applies_nothing(shard, case):
    raw = Raw(shard)
    assert raw.answer()[0] == Kind.WELCOME
    meta = push_header().SerializeToString()
    frame = {"bad magic": HEADER.pack(b"HTTP", Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta,
             "unknown kind": HEADER.pack(MAGIC, 99, 0, 0, 0, 0),
             "meta too long": HEADER.pack(MAGIC, Kind.PUSH, 0, 0, 1 << 30, 0),
             "payload larger than any block": HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), 1 << 60) + meta,
             "payload on a pull": HEADER.pack(MAGIC, Kind.PULL, 0, 0, 0, 4),
             "meta not a PushHeader": HEADER.pack(MAGIC, Kind.PUSH, 0, 0, 3, 0) + b"\xff\xff\xff",
             "length not the block's": HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4 - 4) + meta,
             }[case]
    raw.sock.sendall(frame)
    kind, (error, message) = raw.answer(timeout_s=5)
    assert (kind, error) == (Kind.ERROR, "InvalidArgument"), message
    assert raw.closed() and pushed(shard) == 0


def test_a_gradient_with_nan_is_refused_and_changes_nothing(shard):
    """Not even the fence: a refused push carrying the largest token leaves the lane's fence where it was, so
    the honest holder's push (token 1) still counts."""
    raw = Raw(shard)
    assert raw.answer()[0] == Kind.WELCOME
    send_frame(raw.sock, Kind.PUSH, push_header(fence=2**64 - 1), [np.full(NUMEL, np.nan, "<f4").tobytes()])
    kind, (error, message) = raw.answer()
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and "NaN" in message
    good = Raw(shard)
    assert good.answer()[0] == Kind.WELCOME
    send_frame(good.sock, Kind.PUSH, push_header(fence=1), [gradient(1.0)])
    kind, result = good.answer()
    assert kind == Kind.RESULT and result.pushed == 1 and not result.duplicate


def test_a_silent_connection_is_closed_and_a_push_stalled_within_its_payload_frees_its_row(shard):
    """--stream-idle-s 2: a connection that sends nothing after its hello is closed; a push that stops after
    half its payload ends with DEADLINE_EXCEEDED, and the worker's next push is counted."""
    idle = Raw(shard)
    assert idle.answer()[0] == Kind.WELCOME
    started = time.monotonic()
    assert idle.closed(timeout_s=10, shut=False) and 1.5 < time.monotonic() - started < 6  # by the shard
    stalled = Raw(shard)
    assert stalled.answer()[0] == Kind.WELCOME
    meta = push_header().SerializeToString()
    stalled.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta + gradient(1.0)[:2000])
    kind, (error, message) = stalled.answer(timeout_s=10)
    assert (kind, error) == (Kind.ERROR, "DeadlineExceeded") and "--stream-idle-s" in message
    assert pushed(shard) == 0
    retry = Raw(shard)
    assert retry.answer()[0] == Kind.WELCOME
    send_frame(retry.sock, Kind.PUSH, push_header(), [gradient(2.0)])
    assert retry.answer()[1].pushed == 1


def test_a_newer_push_of_the_row_supersedes_a_stalled_one_at_once(shard):
    stalled = Raw(shard)
    assert stalled.answer()[0] == Kind.WELCOME
    meta = push_header().SerializeToString()
    stalled.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta + gradient(1.0)[:2000])
    time.sleep(0.3)
    retry = Raw(shard)
    assert retry.answer()[0] == Kind.WELCOME
    started = time.monotonic()
    send_frame(retry.sock, Kind.PUSH, push_header(), [gradient(2.0)])
    kind, result = retry.answer()
    assert kind == Kind.RESULT and result.pushed == 1 and time.monotonic() - started < 1.9  # not the idle limit
    assert stalled.closed()


def test_a_pull_on_the_channel_waits_for_the_round_and_names_what_is_missing(shard):
    raw = Raw(shard)
    assert raw.answer()[0] == Kind.WELCOME
    send_frame(raw.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=[BLOCK], worker=0, round=0, timeout_s=0.5))
    kind, (error, message) = raw.answer()
    assert (kind, error) == (Kind.ERROR, "DeadlineExceeded") and "workers [0, 1] have not pushed" in message
    again = Raw(shard)
    assert again.answer()[0] == Kind.WELCOME
    send_frame(again.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=[BLOCK, BLOCK], worker=0, round=0))
    kind, (error, message) = again.answer()
    assert (kind, error) == (Kind.ERROR, "InvalidArgument") and "asked for twice" in message


def test_a_cancelled_pull_ends_its_connection_and_the_client_goes_on(shard):
    async def run():
        client = ShardClient(shard.address, data_path="socket")
        try:
            waiting = asyncio.ensure_future(client.pull_into([(BLOCK, torch.empty(NUMEL))], 0, 0, 30))
            await asyncio.sleep(0.3)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            reply = await client.push([PushItem(BLOCK, torch.ones(NUMEL), 0)], 0, timeout_s=10)
            assert reply.results[0].pushed == 1
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_connections_beyond_the_limit_are_refused_and_a_closed_one_frees_its_place():
    """--max-data-connections 2, both admitted: a third connection gets Busy (UNAVAILABLE, which the worker
    retries) naming the option and is closed; once one of the two closes, the next connection is served."""
    import types

    import grpc

    from imerge.ps.config import PSConfig
    from imerge.ps.server import ThreadedShard
    from imerge.wire.rpc import ps_pb2_grpc

    threaded = ThreadedShard(PSConfig(register=False, max_data_connections=2, metrics_port=-1))
    channel = grpc.insecure_channel(threaded.address)
    shard = types.SimpleNamespace(stub=ps_pb2_grpc.ParameterServerStub(channel))
    try:
        first, second = Raw(shard), Raw(shard)  # (a third stranger beside them would evict the older one)
        assert [raw.answer()[0] for raw in (first, second)] == [Kind.WELCOME, Kind.WELCOME]
        third = Raw(shard)
        assert third.answer() == (Kind.ERROR, ("Busy", "shard 0: all 2 data connections are held by workers "
                                                       "(--max-data-connections): try again"))
        assert third.closed()
        first.close()
        deadline = time.monotonic() + 10
        while True:  # the shard sees the close on the connection's thread
            fourth = Raw(shard)
            kind, meta = fourth.answer()
            if kind == Kind.WELCOME or time.monotonic() > deadline:
                break
            assert meta[0] == "Busy"
            fourth.close()
            time.sleep(0.05)
        assert kind == Kind.WELCOME
        send_frame(fourth.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=["nope"], worker=0, round=0))
        assert fourth.answer()[1][0] == "NotFound"  # served: the block is unknown
        fourth.close()
        second.close()
    finally:
        channel.close()
        threaded.stop()


# -- fuzzing: frames a worker would never send --------------------------------------------------------------
EXAMPLES = 200
kinds = st.one_of(st.sampled_from(list(Kind)), st.integers(0, 255))
metas = st.one_of(st.binary(max_size=40), st.builds(lambda h: h.SerializeToString(), st.builds(
    ps_pb2.PushHeader, block_id=st.sampled_from(["fuzz", "", "x" * 300]), worker=st.integers(0, 3),
    round=st.integers(0, 2), dtype=st.integers(0, 5), numel=st.sampled_from([NUMEL, 0, 2**40]),
    generation=st.integers(0, 2), fence=st.one_of(st.integers(0, 3), st.just(2**64 - 1)), lane=st.integers(0, 2),
    hypers=st.sampled_from(["", '{"lr": 0.5}', '{"lr": [-1]}', '{"lr": 1' + "0" * 400 + "}", '{"nesterov": true}',
                            '{"lr": ' + "[" * 3000 + "]" * 3000 + "}", "not json"]),
    assign=st.booleans(), loss_scale=st.floats(), max_norm=st.floats())),
    st.builds(lambda p: p.SerializeToString(), st.builds(ps_pb2.PullRequest, block_ids=st.lists(
        st.sampled_from(["fuzz", "c", ""]), max_size=3), worker=st.integers(0, 2), round=st.integers(0, 2),
        timeout_s=st.just(0.05))))
payloads = st.one_of(st.binary(max_size=64), st.just(gradient(1.0)), st.just(gradient(float("nan"))))


@pytest.mark.timeout(600)
def test_fuzzed_frames_get_an_error_frame_or_a_close_and_the_shard_goes_on(shard):
    from test_fuzz import process_figures

    spec = ps_pb2.BlockSpec(block_id="fuzz", dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS, optimizer=SGD)
    shard.stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                               ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
    steady = process_figures(shard.process.pid)
    answers: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(kinds, metas, payloads, st.booleans())
    def frame(kind, meta, payload, honest_length):
        raw = Raw(shard, worker=0)
        try:
            assert raw.answer()[0] == Kind.WELCOME
            declared = len(payload) if honest_length else NUMEL * 4
            raw.sock.sendall(struct.pack("<4sBBHIQ", MAGIC, kind, 0, 0, len(meta), declared) + meta + payload)
            raw.sock.shutdown(socket.SHUT_WR)  # what is not there is never coming
            try:
                got, meta_of = raw.answer(timeout_s=5)
            except ConnectionError:
                got, meta_of = "closed", None
            name = got.name if isinstance(got, Kind) else got
            if got == Kind.ERROR:
                name = meta_of[0]
                assert meta_of[0] in {"InvalidArgument", "NotFound", "FailedPrecondition", "PermissionDenied",
                                      "DeadlineExceeded", "FutureGeneration", "StaleGeneration", "Fenced",
                                      "AlreadyExists", "ResourceExhausted"}, meta_of  # never Internal
            answers[name] = answers.get(name, 0) + 1
        finally:
            raw.close()

    frame()
    assert shard.process.poll() is None
    assert answers.get("InvalidArgument", 0) > EXAMPLES // 4, answers
    time.sleep(1.0)  # the connections' threads end
    after = process_figures(shard.process.pid)
    assert after["threads"] <= steady["threads"] + 2 and after["fds"] <= steady["fds"] + 4, (steady, after)
    assert after["rss_kib"] - steady["rss_kib"] < 50 * 1024


def drip(raw: Raw, stop: threading.Event) -> None:
    """A few bytes of the payload every 0.3 s: never silent for --stream-idle-s, far below the minimum rate."""
    with contextlib.suppress(OSError):
        while not stop.wait(0.3):
            raw.sock.sendall(b"\0" * 4)


def test_a_dripping_push_is_superseded_by_its_retry_and_alone_is_ended_after_a_window(shard):
    """--stream-idle-s 2, --stream-min-bytes-per-s 16384 (the default): a push whose payload comes 4 bytes every
    0.3 s is superseded by the retry of its row after a second, and one left alone is ended after one window,
    its row freed. Before, both held the row until the client stopped (the job waited for them)."""
    stop = threading.Event()
    meta = push_header().SerializeToString()
    try:
        dripping = Raw(shard)
        assert dripping.answer()[0] == Kind.WELCOME
        dripping.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta)
        threading.Thread(target=drip, args=(dripping, stop), daemon=True).start()
        time.sleep(0.3)
        retry = Raw(shard)
        assert retry.answer()[0] == Kind.WELCOME
        started = time.monotonic()
        send_frame(retry.sock, Kind.PUSH, push_header(), [gradient(2.0)])
        kind, result = retry.answer()
        assert kind == Kind.RESULT and result.pushed == 1 and time.monotonic() - started < 1.9

        alone = Raw(shard, worker=1)
        assert alone.answer()[0] == Kind.WELCOME
        meta = push_header(worker=1).SerializeToString()
        started = time.monotonic()
        alone.sock.sendall(HEADER.pack(MAGIC, Kind.PUSH, 0, 0, len(meta), NUMEL * 4) + meta)
        threading.Thread(target=drip, args=(alone, stop), daemon=True).start()
        kind, (error, message) = alone.answer(timeout_s=10)
        assert (kind, error) == (Kind.ERROR, "DeadlineExceeded") and "--stream-min-bytes-per-s" in message
        assert time.monotonic() - started < 4
        assert pushed(shard) == 1  # the dripping push of worker 1 was not counted
    finally:
        stop.set()


def test_a_round_goes_through_the_channel_while_the_shards_event_loop_is_busy(redis_url):
    """A plain push is checked, received, counted and (the round's last) stepped on its connection's thread, and
    a pull waits and is answered there: a whole round completes while the shard's event loop cannot run. What
    needs the loop (a retry, compared with the counted bytes) is answered once the loop runs again."""
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="busyloop", register=False))
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(server.address))
    try:
        spec = ps_pb2.BlockSpec(block_id=BLOCK, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS, optimizer=SGD)
        stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                             ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
        raws = [Raw(types.SimpleNamespace(stub=stub), worker=w) for w in range(WORKERS)]
        assert [raw.answer()[0] for raw in raws] == [Kind.WELCOME] * WORKERS
        busy, freeze_s = threading.Event(), 4.0
        server._loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(freeze_s)))
        assert busy.wait(10)
        frozen_at = time.monotonic()
        for worker, raw in enumerate(raws):
            send_frame(raw.sock, Kind.PUSH, push_header(worker), [gradient(worker + 1.0)])
            kind, result = raw.answer(timeout_s=freeze_s / 2)
            assert kind == Kind.RESULT and result.pushed == worker + 1 and not result.duplicate
        send_frame(raws[0].sock, Kind.PULL, ps_pb2.PullRequest(block_ids=[BLOCK], worker=0, round=0, timeout_s=2))
        kind, meta = raws[0].answer(timeout_s=freeze_s / 2)
        assert kind == Kind.BLOCK and meta.round == 1
        pulled = bytearray(NUMEL * 4)
        read_exact(raws[0].sock, memoryview(pulled), "test")
        expected = torch.zeros(NUMEL).add_(torch.full((NUMEL,), 1.5), alpha=-0.1)  # SGD's step of the mean
        assert torch.equal(torch.frombuffer(pulled, dtype=torch.float32), expected)
        assert raws[0].answer()[0] == Kind.END
        assert time.monotonic() - frozen_at < freeze_s  # all of it while the loop slept
        send_frame(raws[1].sock, Kind.PUSH, push_header(1), [gradient(2.0)])  # a retry: the loop compares it
        kind, result = raws[1].answer(timeout_s=2 * freeze_s)
        assert kind == Kind.RESULT and result.duplicate and time.monotonic() - frozen_at >= freeze_s
    finally:
        server.stop()


def test_a_round_due_for_a_checkpoint_is_answered_once_the_loop_copied_the_blocks(redis_url, tmp_path):
    """A round a checkpoint is due at is stepped on the connection's thread but published by the event loop,
    which copies the blocks' images before any pull of the round is answered: no worker can push (and no
    block step) past the checkpoint's round while its images are taken. The checkpoint holds what the pull
    got."""
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="duecheckpoint", register=False, checkpoint_every=1))
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(server.address))
    try:
        spec = ps_pb2.BlockSpec(block_id="due", dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=1, optimizer=SGD)
        stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                             ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
        server.shard.expected, server.shard.checkpoints = {"due"}, CheckpointStore(tmp_path, shard=0)  # as a plan
        raw = Raw(types.SimpleNamespace(stub=stub))
        assert raw.answer()[0] == Kind.WELCOME
        busy, freeze_s = threading.Event(), 2.0
        server._loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(freeze_s)))
        assert busy.wait(10)
        frozen_at = time.monotonic()
        send_frame(raw.sock, Kind.PUSH, push_header(block_id="due"), [gradient(3.0)])
        kind, result = raw.answer(timeout_s=freeze_s / 2)  # counted (and stepped) while the loop sleeps
        assert kind == Kind.RESULT and result.pushed == 1
        send_frame(raw.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=["due"], worker=0, round=0, timeout_s=10))
        kind, meta = raw.answer(timeout_s=3 * freeze_s)
        assert kind == Kind.BLOCK and meta.round == 1 and time.monotonic() - frozen_at >= freeze_s
        pulled = bytearray(NUMEL * 4)
        read_exact(raw.sock, memoryview(pulled), "test")
        assert raw.answer()[0] == Kind.END
        deadline = time.monotonic() + 10
        while 1 not in server.shard.checkpoints.rounds():
            assert time.monotonic() < deadline, "no checkpoint of round 1"
            time.sleep(0.05)
        image = server.shard.checkpoints.read(1).blocks["due"]
        assert torch.equal(image.param, torch.frombuffer(pulled, dtype=torch.float32))
    finally:
        server.stop()


def test_close_ends_a_connection_whose_shard_never_answers_the_hello():
    """A call waiting for a shard's WELCOME (a shard that accepted the connection and hangs) ends when the client
    closes, at once, and the close does not wait out the call's timeout for the pool's thread."""
    from imerge.core.errors import Unavailable
    from imerge.worker.datachannel import SocketDataPath

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never speaks

    async def open_channel(worker: int, generation: int) -> ps_pb2.ChannelReply:
        return ps_pb2.ChannelReply(port=silent.getsockname()[1], token=b"t", idle_s=30)

    async def run() -> tuple[BaseException | None, float]:
        path = SocketDataPath("127.0.0.1:1", open_channel)
        push = asyncio.ensure_future(path.push([PushItem(BLOCK, torch.zeros(NUMEL), 0)], 0, timeout_s=30))
        await asyncio.sleep(0.5)  # the pool's thread waits for the WELCOME
        assert not push.done()
        started = time.monotonic()
        await path.close()
        took = time.monotonic() - started
        try:
            await asyncio.wait_for(push, 5)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc, took
        return None, took

    try:
        error, took = asyncio.run(run())
    finally:
        silent.close()
    assert isinstance(error, Unavailable) and "closed" in str(error) and took < 2, (error, took)


def test_a_refusal_that_cuts_a_large_push_short_reaches_the_worker_by_its_name():
    """A shard that refuses a push as soon as it read the frame's header answers an ERROR frame and closes without
    reading the rest (as a shard does once it has dropped --drain's bytes): the worker's write of the payload
    fails, and the worker reads the refusal that came before the close, not a broken pipe."""
    from imerge.wire.datapath import error_meta
    from imerge.worker.datachannel import SocketDataPath

    listener = socket.create_server(("127.0.0.1", 0))
    refused = AlreadyExists("push of block b by worker 0 for round 0: two clients push as worker 0")

    def abrupt_shard() -> None:
        conn, _ = listener.accept()
        with conn:
            read_meta(conn, read_header(conn, 1 << 20, "test"), ps_pb2.ChannelHello, "test")
            send_frame(conn, Kind.WELCOME)
            read_meta(conn, read_header(conn, 1 << 30, "test"), ps_pb2.PushHeader, "test")
            send_frame(conn, Kind.ERROR, error_meta(refused, ps_pb2.ChannelError))
            time.sleep(0.2)  # the worker goes on writing; the close resets its connection
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def open_channel(worker: int, generation: int) -> ps_pb2.ChannelReply:
        return ps_pb2.ChannelReply(port=listener.getsockname()[1], token=b"t", idle_s=30)

    async def run() -> None:
        path = SocketDataPath("127.0.0.1:1", open_channel)
        try:
            await path.push([PushItem(BLOCK, torch.zeros(16 << 20), 0)], 0, timeout_s=30)  # 64 MiB
        finally:
            await path.close()

    shard_thread = threading.Thread(target=abrupt_shard, daemon=True)
    shard_thread.start()
    try:
        with pytest.raises(AlreadyExists, match="two clients push as worker 0"):
            asyncio.run(run())
    finally:
        shard_thread.join(10)
        listener.close()


def test_a_round_due_for_a_checkpoint_waits_until_the_previous_checkpoint_is_written(redis_url, tmp_path):
    """A shard never runs more than one checkpoint ahead of its disk: a round due for a checkpoint is answered
    only once the previous checkpoint is written (here the writer is held), so that shards whose disks differ
    in speed still hold a round in common among the checkpoints they keep."""
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="slowdisk", register=False, checkpoint_every=1))
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(server.address))
    held = threading.Event()
    try:
        spec = ps_pb2.BlockSpec(block_id="due", dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=1, optimizer=SGD)
        stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                             ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
        server.shard.expected, server.shard.checkpoints = {"due"}, CheckpointStore(tmp_path, shard=0)
        server.shard._writer.submit(held.wait, 30)  # the disk is busy: every write waits behind this one
        raw = Raw(types.SimpleNamespace(stub=stub))
        assert raw.answer()[0] == Kind.WELCOME

        def round_trip(round_: int, within_s: float) -> tuple[Kind, object]:
            send_frame(raw.sock, Kind.PUSH, push_header(block_id="due", round_=round_), [gradient(1.0)])
            assert raw.answer()[0] == Kind.RESULT
            send_frame(raw.sock, Kind.PULL, ps_pb2.PullRequest(block_ids=["due"], worker=0, round=round_,
                                                                timeout_s=20))
            return raw.answer(timeout_s=within_s)

        kind, meta = round_trip(0, 5)  # round 1's checkpoint is queued behind the busy disk; round 1 goes on
        assert kind == Kind.BLOCK and meta.round == 1
        read_exact(raw.sock, memoryview(bytearray(NUMEL * 4)), "test")
        assert raw.answer()[0] == Kind.END
        with pytest.raises(TimeoutError):  # round 2 waits for round 1's checkpoint
            round_trip(1, 1.0)
        held.set()
        kind, meta = raw.answer(timeout_s=10)
        assert kind == Kind.BLOCK and meta.round == 2 and 1 in server.shard.checkpoints.rounds()
    finally:
        held.set()
        server.stop()


def test_an_aborted_connection_keeps_its_descriptor_until_the_call_in_it_returns():
    """A worker's connection aborted (a cancelled call, the channel closed) while a thread is in a call on it is
    shut down at once, which ends the call's wait in the data plane's native read, but its descriptor stays
    open until that call returns: closed at once, its number went to the next socket opened, and a call still
    holding the number (the native loops do, the GIL released) waited on, or read, that stranger's connection.
    A call asked for after the abort does not begin."""
    from imerge.core.native import data_plane
    from imerge.wire.datapath import ChannelClosed
    from imerge.worker.datachannel import PooledConnection

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    connection, seen = PooledConnection(client), {}
    in_call, aborted = threading.Event(), threading.Event()

    def read_a_head(sock: socket.socket) -> int:
        seen["fd"] = sock.fileno()
        in_call.set()
        assert aborted.wait(10)
        state, _ = data_plane().recv_head(sock, HEADER.size, 8, 64) or (None, b"")
        seen["after"] = sock.fileno()
        return state

    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(connection.call(read_a_head)))
    thread.start()
    try:
        assert in_call.wait(10)
        connection.abort()
        fresh = socket.socket()  # the lowest free descriptor
        try:
            assert fresh.fileno() != seen["fd"], "the aborted connection's descriptor was reused under its call"
        finally:
            fresh.close()
        aborted.set()
        thread.join(10)
        assert not thread.is_alive()
        assert seen["after"] == seen["fd"] and client.fileno() == -1  # open throughout the call, closed after it
        if data_plane().name == "native":
            assert result == [1]  # the native read saw the shutdown: closed
        assert connection.aborted  # the pool does not take it back
        with pytest.raises(ChannelClosed, match="ended before its call began"):
            connection.call(read_a_head)
    finally:
        aborted.set()
        server.close()
        listener.close()
