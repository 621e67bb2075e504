"""The worker's gRPC client of the PS shards: the only worker module that touches gRPC.

Every call runs on the worker's comm event loop. Failures are translated at
one choke point (:func:`_translated`) back into the class of the one error
hierarchy the shard raised (see :mod:`imerge.wire.status`), naming the
shard's address.
"""
from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import torch

from imerge.core.codec import CHUNK_BYTES, ChunkAssembler, tensor_view
from imerge.core.config import TlsConfig
from imerge.core.errors import InvalidArgument
from imerge.core.optim import OptimizerSpec
from imerge.wire.channel import CHANNEL_OPTIONS, SERVICE_NAME
from imerge.wire.encoding import push_header
from imerge.wire.frames import data_frames, deserializer, serialize
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc
from imerge.wire.status import error_from
from imerge.wire.tls import channel_credentials, client_ssl_context

from .datachannel import SocketDataPath
from .items import BlockArrived, DataPath, PushItem
from .pulled import PulledBlocks, apply_payload

OPEN_CHANNEL_TIMEOUT_S = 30.0


def _translated(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: "ShardClient", *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc, self.address) from None

    return wrapper


class _Incoming:
    """One pulled block's data chunks on their way into its target (a compressed block: into a buffer first,
    applied when whole)."""

    def __init__(self, pulled: PulledBlocks, meta: ps_pb2.TensorMeta, on_block: BlockArrived | None):
        self.meta, self._on_block = meta, on_block
        self._target = pulled.target(meta)
        self._receiver = pulled.receiver(meta, self._target)
        self._assembler = ChunkAssembler(self._target, f"{pulled.address}: {pulled.what}: block {meta.block_id}") \
            if self._receiver is None else None

    def feed(self, data: bytes) -> None:
        if self._assembler is not None:
            self._assembler.feed(data)
        else:
            assert self._receiver is not None
            self._receiver.feed(data)

    def finish(self) -> None:
        if self._assembler is not None:
            self._assembler.finish()
        else:
            assert self._receiver is not None
            apply_payload(self._target, self._receiver.finish())
        if self._on_block is not None:
            self._on_block(self.meta.block_id, self.meta.round, self.meta)


async def receive_into(call: Any, pulled: PulledBlocks, on_block: BlockArrived | None = None) -> list[int]:
    """Read a Pull's or Fetch's (meta, data...) per block into its target, in whatever order the shard answers
    them (a pull sends each block as soon as its round completes); ``on_block(block_id, round, meta)`` as each
    block is complete. Return each target's round, in the targets' order."""
    current: _Incoming | None = None
    async for chunk in call:
        if chunk.WhichOneof("part") == "meta":
            if current is not None:
                current.finish()
            current = _Incoming(pulled, chunk.meta, on_block)
        elif current is None:
            raise InvalidArgument(f"{pulled.what}: the shard's reply did not start with a block's meta",
                                  address=pulled.address)
        else:
            current.feed(chunk.data)
    if current is not None:
        current.finish()
    return pulled.finish()


class GrpcDataPath:
    """Pushes and pulls of one shard on gRPC's streams (``--data-path grpc``): a push stream of a header and
    1 MiB data frames per block, a pull answered block by block as each completes."""

    def __init__(self, address: str, channel: grpc.aio.Channel):
        self.address = address
        method = f"/{SERVICE_NAME}/"  # the data-carrying methods with the lean encoding of imerge.wire.frames
        self._push = channel.stream_unary(method + "Push", request_serializer=serialize,
                                          response_deserializer=ps_pb2.PushReply.FromString)
        self._pull = channel.unary_stream(method + "Pull", request_serializer=serialize,
                                          response_deserializer=deserializer(ps_pb2.TensorChunk))

    async def close(self) -> None:
        """Nothing of its own: it rides on the client's channel."""

    async def push(self, blocks: list[PushItem], worker: int, timeout_s: float, generation: int = 0,
                   fence: int = 0, lane: int = 0, on_written: Callable[[], None] | None = None
                   ) -> ps_pb2.PushReply:
        async def segments() -> AsyncIterator[ps_pb2.PushChunk | bytes]:
            for item in blocks:
                payload = item.payload
                yield ps_pb2.PushChunk(header=push_header(item.push(worker, generation, fence, lane)))
                for part in payload.parts():
                    for frame in data_frames(part, CHUNK_BYTES):  # PushChunk data, encoded once
                        yield frame
            if on_written is not None:
                on_written()

        try:
            reply: ps_pb2.PushReply = await self._push(segments(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc, self.address) from None
        return reply

    async def pull_into(self, targets: list[tuple[str, torch.Tensor]], worker: int, round_: int, timeout_s: float,
                        generation: int = 0, on_block: BlockArrived | None = None) -> list[int]:
        request = ps_pb2.PullRequest(block_ids=[b for b, _ in targets], worker=worker, round=round_,
                                     timeout_s=timeout_s, generation=generation)
        call = self._pull(request, timeout=timeout_s + 5.0)
        try:
            return await receive_into(call, PulledBlocks(targets, "pull", self.address), on_block)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc, self.address) from None
        except BaseException:  # refused, or cancelled: the shard stops waiting for it too
            call.cancel()
            raise


class ShardClient:
    """One shard's calls. With ``data_path`` "socket", pushes and pulls travel on the shard's data channel
    (:mod:`.datachannel`), opened through :meth:`open_channel`; everything else is gRPC."""

    def __init__(self, address: str, tls: TlsConfig | None = None, data_path: str = "grpc"):
        self.address = address
        self._channel = (grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)
                         if tls is not None and tls.tls_client
                         else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        # the data-carrying methods with the lean data path (imerge.wire.frames): same messages on the wire
        method = f"/{SERVICE_NAME}/"
        self._init = self._channel.stream_unary(method + "InitBlock", request_serializer=serialize,
                                                response_deserializer=ps_pb2.InitBlockReply.FromString)
        self._fetch = self._channel.unary_stream(method + "Fetch", request_serializer=serialize,
                                                 response_deserializer=deserializer(ps_pb2.TensorChunk))
        self._data: DataPath = (SocketDataPath(address, self.open_channel,
                                               client_ssl_context(tls) if tls is not None and tls.tls_client
                                               else None)
                                if data_path == "socket" else GrpcDataPath(address, self._channel))

    async def close(self) -> None:
        await self._data.close()
        await self._channel.close(grace=None)

    @_translated
    async def open_channel(self, worker: int, generation: int) -> ps_pb2.ChannelReply:
        """The shard's data channel: its port and this worker's token for ``generation``."""
        reply: ps_pb2.ChannelReply = await self._stub.OpenChannel(
            ps_pb2.ChannelRequest(worker=worker, generation=generation), timeout=OPEN_CHANNEL_TIMEOUT_S)
        return reply

    @_translated
    async def init_block(self, block_id: str, num_workers: int, optimizer: OptimizerSpec,
                         init: torch.Tensor, timeout_s: float,
                         segments: Sequence[int] = (), compression: str = "") -> ps_pb2.InitBlockReply:
        options = json.dumps(optimizer.kwargs, sort_keys=True)
        spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=init.numel(),
                                num_workers=num_workers, segments=segments, compression=compression,
                                optimizer=ps_pb2.OptimizerSpec(name=optimizer.name, options_json=options))

        async def chunks() -> AsyncIterator[ps_pb2.InitBlockChunk | bytes]:
            yield ps_pb2.InitBlockChunk(spec=spec)
            for frame in data_frames(tensor_view(init), CHUNK_BYTES):
                yield frame

        reply: ps_pb2.InitBlockReply = await self._init(chunks(), timeout=timeout_s)
        return reply

    async def push(self, blocks: list[PushItem], worker: int, timeout_s: float,
                   generation: int = 0, fence: int = 0, lane: int = 0,
                   on_written: Callable[[], None] | None = None) -> ps_pb2.PushReply:
        """Push several blocks' gradients in one call: a header, then the data, per block. ``on_written`` is
        called (on the comm loop) once the last data has been handed to the data path."""
        reply: ps_pb2.PushReply = await self._data.push(blocks, worker, timeout_s, generation, fence, lane,
                                                        on_written)
        return reply

    async def pull_into(self, targets: list[tuple[str, torch.Tensor]], worker: int, round_: int,
                        timeout_s: float, generation: int = 0, on_block: BlockArrived | None = None) -> list[int]:
        """Wait for ``round_`` of the blocks, writing each block's parameters into its target as soon as the shard
        completes it (``on_block`` is told); return the new rounds. May be issued while the push is in flight."""
        return await self._data.pull_into(targets, worker, round_, timeout_s, generation, on_block)

    @_translated
    async def fetch_into(self, targets: list[tuple[str, torch.Tensor]], timeout_s: float,
                         generation: int = 0) -> list[int]:
        """The blocks' current parameters; waits up to ``timeout_s`` for an unreachable shard to come back."""
        call = self._fetch(ps_pb2.FetchRequest(block_ids=[b for b, _ in targets], generation=generation),
                           timeout=timeout_s, wait_for_ready=True)
        return await receive_into(call, PulledBlocks(targets, "fetch", self.address))

    @_translated
    async def export_blocks(self, block_ids: list[str], timeout_s: float, generation: int = 0) -> dict[str, bytes]:
        """Each block's parameters and optimizer state (safetensors bytes, see the shard's Export)."""
        exported: dict[str, bytearray] = {}
        current: bytearray | None = None
        request = ps_pb2.ExportRequest(block_ids=block_ids, generation=generation)
        async for chunk in self._stub.Export(request, timeout=timeout_s):
            if chunk.WhichOneof("part") == "meta":
                current = exported.setdefault(chunk.meta.block_id, bytearray())
            elif current is None:
                raise InvalidArgument("Export: data before a block's meta", address=self.address)
            else:
                current.extend(chunk.data)
        missing = sorted(set(block_ids) - set(exported))
        if missing:
            raise InvalidArgument(f"Export: the shard sent no state of blocks {missing}", address=self.address)
        return {block_id: bytes(data) for block_id, data in exported.items()}

    @_translated
    async def import_blocks(self, states: dict[str, bytes], timeout_s: float, generation: int = 0) -> None:
        """Replace each block's parameters and optimizer state (at a round no worker pushed yet)."""

        async def chunks() -> AsyncIterator[ps_pb2.BlockStateChunk]:
            for block_id, data in states.items():
                yield ps_pb2.BlockStateChunk(meta=ps_pb2.BlockStateMeta(block_id=block_id, nbytes=len(data),
                                                                        generation=generation))
                for start in range(0, len(data), CHUNK_BYTES):
                    yield ps_pb2.BlockStateChunk(data=data[start:start + CHUNK_BYTES])

        await self._stub.Import(chunks(), timeout=timeout_s)

    @_translated
    async def stats(self, timeout_s: float) -> ps_pb2.StatsReply:
        reply: ps_pb2.StatsReply = await self._stub.Stats(ps_pb2.StatsRequest(), timeout=timeout_s)
        return reply
