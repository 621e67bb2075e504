"""The contract every data path keeps (``DataPath`` in ``imerge.worker.items``), run over each: the data channel
(``--data-path socket``) and gRPC's streams (``--data-path grpc``), against a real shard process.

Ordering and bits, duplicates and second writers, refusals as the shard's error classes (before a byte of a
refused payload changes the block), fencing, deadlines that name who is missing, compressed payloads."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from imerge.core.compression import make_compressor, parse_mode
from imerge.core.errors import (AlreadyExists, DeadlineExceeded, FailedPrecondition, Fenced, FutureGeneration,
                                InvalidArgument, NotFound)
from imerge.wire.rpc import ps_pb2
from imerge.worker.items import PushItem
from imerge.worker.transport import ShardClient

from test_request_bounds import ShardProcess

NUMEL, WORKERS = 10_007, 2
SGD = ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}')
DATA_PATHS = ["socket", "grpc"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    process = ShardProcess(tmp_path_factory.mktemp("shard"), "--stream-idle-s", "5")
    yield process
    process.stop()


@pytest.fixture(params=DATA_PATHS)
def data_path(request):
    return request.param


def make_block(shard: ShardProcess, name: str, compression: str = "") -> str:
    block = name[:200]
    spec = ps_pb2.BlockSpec(block_id=block, dtype=ps_pb2.FLOAT32, numel=NUMEL, num_workers=WORKERS, optimizer=SGD,
                            compression=compression)
    shard.stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                               ps_pb2.InitBlockChunk(data=np.zeros(NUMEL, "<f4").tobytes())]), timeout=30)
    return block


def pushed(shard: ShardProcess, block: str) -> int:
    return next(b for b in shard.stub.Stats(ps_pb2.StatsRequest(), timeout=10).blocks if b.block_id == block).pushed


def run(coroutine):
    return asyncio.run(coroutine)


async def clients(shard: ShardProcess, data_path: str, count: int = WORKERS) -> list[ShardClient]:
    return [ShardClient(shard.address, data_path=data_path) for _ in range(count)]


def test_two_workers_push_and_pull_bit_exactly_with_duplicates_and_second_writers(shard, data_path, request):
    blocks = [make_block(shard, f"{request.node.name}-{index}") for index in range(3)]
    grads = {(w, b): torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * w + i))
             for w in range(WORKERS) for i, b in enumerate(blocks)}

    async def worker(client: ShardClient, w: int) -> dict[str, torch.Tensor]:
        items = [PushItem(block, grads[w, block], 0) for block in blocks]
        reply = await client.push(items, w, timeout_s=20)
        assert [r.block_id for r in reply.results] == blocks and not any(r.duplicate for r in reply.results)
        targets = {block: torch.empty(NUMEL) for block in blocks}
        arrived: list[tuple[str, int]] = []
        rounds = await client.pull_into(list(targets.items()), w, 0, 20,
                                        on_block=lambda block, round_, meta: arrived.append((block, round_)))
        assert rounds == [1, 1, 1] and sorted(arrived) == sorted((block, 1) for block in blocks)
        again = await client.push(items[:1], w, timeout_s=20)  # a retry of the same bytes
        assert again.results[0].duplicate
        with pytest.raises(AlreadyExists, match=f"two clients push as worker {w}"):  # other bytes: refused
            await client.push([PushItem(blocks[0], grads[w, blocks[0]] + 1, 0)], w, timeout_s=20)
        return targets

    async def both():
        connected = await clients(shard, data_path)
        try:
            return await asyncio.gather(*(worker(client, w) for w, client in enumerate(connected)))
        finally:
            for client in connected:
                await client.close()

    results = run(both())
    for block in blocks:
        mean = grads[0, block].clone().add_(grads[1, block]).div_(WORKERS)
        expected = torch.zeros(NUMEL).add_(mean, alpha=-0.1)
        for result in results:
            assert torch.equal(result[block].view(torch.int32), expected.view(torch.int32))


def test_refusals_raise_the_shards_error_class_and_the_client_goes_on(shard, data_path, request):
    block = make_block(shard, request.node.name)

    async def go():
        (client,) = await clients(shard, data_path, 1)
        try:
            with pytest.raises(FailedPrecondition, match="current round is 0") as refused:
                await client.push([PushItem(block, torch.ones(NUMEL), 3)], 0, timeout_s=10)
            assert refused.value.address == shard.address
            with pytest.raises(NotFound):
                await client.pull_into([("nope", torch.empty(NUMEL))], 0, 0, 2)
            with pytest.raises(FutureGeneration, match="generation 7"):
                await client.push([PushItem(block, torch.ones(NUMEL), 0)], 0, timeout_s=10, generation=7)
            with pytest.raises(InvalidArgument, match="elements"):  # checked before a byte is applied
                await client.push([PushItem(block, torch.ones(NUMEL + 1), 0)], 0, timeout_s=10)
            assert pushed(shard, block) == 0
            reply = await client.push([PushItem(block, torch.ones(NUMEL), 0)], 0, timeout_s=10)
            assert reply.results[0].pushed == 1
        finally:
            await client.close()

    run(go())


def test_a_push_says_once_on_the_callers_loop_that_its_data_is_written_before_it_returns(shard, data_path, request):
    block = make_block(shard, request.node.name)

    async def go():
        (client,) = await clients(shard, data_path, 1)
        told: list[int] = []
        try:  # the comm loop starts the shard's next push stream on this word, before the shard's answer
            reply = await client.push([PushItem(block, torch.ones(NUMEL), 0)], 0, timeout_s=10,
                                      on_written=lambda: told.append(threading.get_ident()))
            assert told == [threading.get_ident()] and reply.results[0].pushed == 1
        finally:
            await client.close()

    run(go())


def test_a_push_with_an_older_fencing_token_is_fenced(shard, data_path, request):
    block = make_block(shard, request.node.name)

    async def go():
        first, second = await clients(shard, data_path)
        try:
            await first.push([PushItem(block, torch.ones(NUMEL), 0)], 0, timeout_s=10, fence=50, lane=3)
            with pytest.raises(Fenced, match="token 40 is older than token 50"):
                await second.push([PushItem(block, torch.ones(NUMEL), 0)], 1, timeout_s=10, fence=40, lane=3)
            assert pushed(shard, block) == 1
            await second.push([PushItem(block, torch.ones(NUMEL), 0)], 1, timeout_s=10, fence=40, lane=4)
            deadline = time.monotonic() + 10  # both counted: the round completes (its step runs on a thread)
            while pushed(shard, block) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert pushed(shard, block) == 0
        finally:
            await first.close()
            await second.close()

    run(go())


def test_a_pull_that_waits_too_long_names_the_missing_workers(shard, data_path, request):
    block = make_block(shard, request.node.name)

    async def go():
        (client,) = await clients(shard, data_path, 1)
        try:
            await client.push([PushItem(block, torch.ones(NUMEL), 0)], 0, timeout_s=10)
            with pytest.raises(DeadlineExceeded, match=r"workers \[1\] have not pushed"):
                await client.pull_into([(block, torch.empty(NUMEL))], 0, 0, 1.0)
        finally:
            await client.close()

    run(go())


@pytest.mark.parametrize("mode", ["fp16", "topk:0.1"])
def test_compressed_payloads_travel_both_ways(shard, data_path, mode, request):
    block = make_block(shard, f"{request.node.name}", compression=mode)
    grads = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(w)) for w in range(WORKERS)]

    async def go():
        connected = await clients(shard, data_path)
        try:
            async def one(w: int, client: ShardClient) -> torch.Tensor:
                payload, _ = make_compressor(parse_mode(mode), NUMEL).compress(grads[w])
                await client.push([PushItem(block, payload, 0)], w, timeout_s=10)
                target = torch.zeros(NUMEL)
                assert await client.pull_into([(block, target)], w, 0, 10) == [1]
                return target

            return await asyncio.gather(*(one(w, c) for w, c in enumerate(connected)))
        finally:
            for client in connected:
                await client.close()

    first, second = run(go())
    assert torch.equal(first, second) and bool(first.abs().sum() > 0)
