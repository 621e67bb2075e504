"""The worker's gRPC client of the PS shards: the only worker module that touches gRPC.

Every call runs on the worker's comm event loop. Failures are translated at
one choke point (:func:`_translated`) into :class:`RemoteError` carrying the
gRPC status name and the shard's address.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch

from imerge.codec import CHUNK_BYTES, ChunkAssembler, iter_chunks, tensor_view
from imerge.errors import InvalidArgument, RemoteError
from imerge.optim import OptimizerSpec
from imerge.rpc import ps_pb2, ps_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES + 4096),
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES + 4096),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def _translated(method: Callable) -> Callable:
    @functools.wraps(method)
    async def wrapper(self: "ShardClient", *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except grpc.aio.AioRpcError as exc:
            raise RemoteError(exc.details() or exc.code().name, exc.code().name, self.address) from None

    return wrapper


async def _stream(first: Any, data: memoryview, make_chunk: Callable[[bytes], Any]) -> AsyncIterator[Any]:
    yield first
    for piece in iter_chunks(data):
        yield make_chunk(piece)


class ShardClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    @_translated
    async def init_block(self, block_id: str, num_workers: int, optimizer: OptimizerSpec,
                         init: torch.Tensor, timeout_s: float) -> ps_pb2.InitBlockReply:
        spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=init.numel(),
                                num_workers=num_workers,
                                optimizer=ps_pb2.OptimizerSpec(**dataclasses.asdict(optimizer)))
        chunks = _stream(ps_pb2.InitBlockChunk(spec=spec), tensor_view(init),
                         lambda piece: ps_pb2.InitBlockChunk(data=piece))
        return await self._stub.InitBlock(chunks, timeout=timeout_s)

    @_translated
    async def push(self, block_id: str, worker: int, round_: int, grad: torch.Tensor,
                   timeout_s: float) -> ps_pb2.PushReply:
        header = ps_pb2.PushHeader(block_id=block_id, worker=worker, round=round_, dtype=ps_pb2.FLOAT32,
                                   numel=grad.numel())
        chunks = _stream(ps_pb2.PushChunk(header=header), tensor_view(grad),
                         lambda piece: ps_pb2.PushChunk(data=piece))
        return await self._stub.Push(chunks, timeout=timeout_s)

    async def _receive_into(self, call: Any, target: torch.Tensor, what: str) -> int:
        first = await anext(aiter(call), None)
        if first is None or first.WhichOneof("part") != "meta":
            raise InvalidArgument(f"{what}: the shard's reply did not start with the tensor's meta")
        if first.meta.numel != target.numel():
            raise InvalidArgument(f"{what}: the shard sent {first.meta.numel} elements, expected {target.numel()}")
        assembler = ChunkAssembler(target, what)
        async for chunk in call:
            assembler.feed(chunk.data)
        assembler.finish()
        return first.meta.round

    @_translated
    async def pull_into(self, block_id: str, worker: int, round_: int, target: torch.Tensor,
                        timeout_s: float) -> int:
        """Wait for ``round_`` to complete, write the parameters into ``target``; return the new round."""
        request = ps_pb2.PullRequest(block_id=block_id, worker=worker, round=round_, timeout_s=timeout_s)
        call = self._stub.Pull(request, timeout=timeout_s + 5.0)
        return await self._receive_into(call, target, f"pull of block {block_id}")

    @_translated
    async def fetch_into(self, block_id: str, target: torch.Tensor, timeout_s: float) -> int:
        call = self._stub.Fetch(ps_pb2.FetchRequest(block_id=block_id), timeout=timeout_s)
        return await self._receive_into(call, target, f"fetch of block {block_id}")

    @_translated
    async def stats(self, timeout_s: float) -> ps_pb2.StatsReply:
        return await self._stub.Stats(ps_pb2.StatsRequest(), timeout=timeout_s)
