"""The shard's gRPC server: the only module of the shard that touches gRPC.

Streams are parsed here into calls on :class:`Shard`; every
:class:`RequestError` becomes a gRPC status at one choke point
(:func:`_unary` / :func:`_streaming`), and any other exception becomes
INTERNAL with the error logged, so one bad request never harms the others.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from imerge.core.planning import FIRST_PLAN
from imerge.control.messages import PostedScalars, RoundScalars
from imerge.control.store import ShardStore
from imerge.core.codec import CHUNK_BYTES
from imerge.core.memory import keep_freed_memory
from imerge.core.scheduling import apply_thread_policy, thread_under
from imerge.core.native import data_plane
from imerge.core.errors import (ConfigError, FailedPrecondition, IMergeError, InvalidArgument, RequestError,
                                ResourceExhausted)
from imerge.core.identity import require_loader, require_worker
from imerge.core.limits import MAX_EXPORTS, MIN_PARKED_PULLS, PARKED_PULLS_PER_BLOCK, check_block_ids, clip
from imerge.core.optim_args import parse_json_object
from imerge.core.ports import bind_problem
from imerge.core.optim import OptimizerSpec
from imerge.telemetry.metrics import MetricsServer, report_port
from imerge.wire.channel import SERVER_OPTIONS, SERVICE_NAME
from imerge.wire.encoding import dtype_name, push_of, tensor_meta
from imerge.wire.frames import serialize
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc
from imerge.wire.status import status_of
from imerge.wire.tls import server_credentials, server_ssl_context

from .checkpoint import CheckpointStore
from .config import PSConfig
from .datachannel import DataChannel
from .fencing import IssuedTokens
from .membership import ShardMembership
from .payloads import ChunkStream
from .block import BlockMeta, Snapshot
from .state import Shard
from .streams import (Progressing, Segments, Undecodable, data_parts, decoded, first_part, parser, receive_exact,
                      receive_states)

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]
PUSH_DRAIN_BYTES = 64 << 20  # what a refused push may still read of its stream before answering


def optimizer_from_proto(spec: ps_pb2.OptimizerSpec) -> OptimizerSpec:
    options = parse_json_object(spec.options_json, "optimizer options")
    if "groups" in options:
        raise InvalidArgument("optimizer options: a block's optimizer is one parameter group (no \"groups\")")
    return OptimizerSpec(spec.name, **options)


async def _status_from(exc: Exception, shard: Shard, context: Context) -> None:
    if isinstance(exc, RequestError):  # its text may quote a client's: clipped
        shard.counters.rejected += 1
        log.warning("rejected (%s %s): %s", exc.status, type(exc).__name__, clip(str(exc), 1000))
        code, trailing = status_of(exc)
        await context.abort(code, clip(str(exc), 4000), trailing_metadata=trailing)
    log.exception("internal error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def method_handlers(servicer: Any, module: Any = ps_pb2, service_name: str = "ParameterServer"
                    ) -> grpc.GenericRpcHandler[Any, Any]:
    """The service's handlers, built from its descriptor, with deserializers that never raise."""
    service = module.DESCRIPTOR.services_by_name[service_name]
    factories = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for method in service.methods:
        request, reply = (getattr(module, t.name) for t in (method.input_type, method.output_type))
        factory = factories[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=parser(request),
                                        response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


class HealthGate:
    """grpc.health.v1.Health served through :func:`method_handlers`: bytes that are not a request get
    INVALID_ARGUMENT (gRPC's own deserializer would answer UNKNOWN); a request goes to the health servicer."""

    def __init__(self, health: Any):
        self._health = health

    async def Check(self, request: Any, context: Context) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.what)
        return await self._health.Check(request, context)

    async def List(self, request: Any, context: Context) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.what)
        return await self._health.List(request, context)

    async def Watch(self, request: Any, context: Context) -> None:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.what)
        await self._health.Watch(request, context)


def _unary(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: "ParameterServerServicer", request: Any, context: Context) -> Any:
        try:
            return await method(self, decoded(request), context)
        except Exception as exc:  # the one choke point for unary replies
            await _status_from(exc, self.shard, context)

    return wrapper


def _streaming(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: "ParameterServerServicer", request: Any,
                      context: Context) -> AsyncIterator[Any]:
        try:
            async for reply in method(self, decoded(request), context):
                yield reply
        except Exception as exc:  # the one choke point for streamed replies
            await _status_from(exc, self.shard, context)

    return wrapper


def _certificate_names(context: Context) -> list[str]:
    auth = context.auth_context()
    return [value.decode(errors="replace") for key in ("x509_subject_alternative_name", "x509_common_name")
            for value in auth.get(key, [])]


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, shard: Shard, config: PSConfig, store: ShardStore | None = None):
        self.shard = shard
        self.config = config
        self.store = store
        self._owned: set[str] | None = None
        self._mapping: dict[str, int] = {}
        self._numels: dict[str, int] = {}
        self._num_workers = 0
        self._holders: list[int] = []  # the shards that hold blocks: those that agree on round scalars
        self.channel: DataChannel | None = None
        self._parked: collections.Counter[str] = collections.Counter()  # connection -> block waits of its pulls
        self._exports = 0  # Export calls in flight

    async def load_plan(self) -> None:
        """Read the mapping table once: the blocks this shard owns, the job's worker count, the run."""
        if self._owned is not None or self.store is None:
            return
        published = await asyncio.to_thread(self.store.read_plan, FIRST_PLAN)
        if published is None or published.plan is None:
            raise FailedPrecondition(f"job {self.config.job} has no published plan yet")
        plan = published.plan
        if self.config.checkpoint_dir:  # this run's checkpoints: the run id comes with generation 0
            start = await asyncio.to_thread(self.store.generation_event, 0)
            self.shard.checkpoints = CheckpointStore(self.config.checkpoint_dir, self.shard.index,
                                                     self.config.checkpoint_keep, start.run if start else "")
        self._owned = {b.block_id for b in plan.blocks if b.shard == self.shard.index}
        self._holders = sorted({b.shard for b in plan.blocks})
        self._tell_channel()
        self._mapping = {b.block_id: b.shard for b in plan.blocks}
        self._numels = {b.block_id: b.numel for b in plan.blocks}
        self.shard.metrics.planned_bytes.set(plan.shard_bytes(self.shard.index))
        self._num_workers = plan.num_workers
        self.shard.expected = set(self._owned)

    def attach_channel(self, channel: DataChannel) -> None:
        self.channel = channel
        self._tell_channel()

    def _tell_channel(self) -> None:
        """The data channel's pulls take turns by how many shards feed a worker (:mod:`.turns`)."""
        if self.channel is not None and self._holders:
            self.channel.turns.shards = len(self._holders)

    async def exchange(self, round_: int, scalars: RoundScalars) -> RoundScalars:
        """The job's scalars of ``round_``: this shard's, plus every other block-holding shard's (summed in shard
        order, so that every shard computes the same totals)."""
        if self.store is None:
            return scalars
        await self.load_plan()
        if self._holders == [self.shard.index]:
            return scalars
        generation, index, timeout = self.shard.generation, self.shard.index, self.config.pull_timeout_s
        await asyncio.to_thread(self.store.post_round_scalars, generation, round_, PostedScalars(index, scalars),
                                self._holders, max(600.0, 4 * timeout))
        received = await asyncio.to_thread(self.store.wait_round_scalars, generation, round_, index, self._holders,
                                           timeout)
        total = RoundScalars()
        for shard in self._holders:
            total = total.plus(received[shard])
        return total

    async def _check_owner(self, meta: BlockMeta) -> None:
        """A block may only be created on the shard the job's mapping table assigns it to, of the size it
        gives and for the job's worker count (which bound what the shard reads and allocates)."""
        if self.store is None:
            return
        await self.load_plan()
        block_id = meta.block_id
        if self._owned is None or block_id not in self._owned:
            where = self._mapping.get(block_id)
            raise FailedPrecondition(f"block {block_id} is mapped to "
                                     f"{'no shard' if where is None else f'shard {where}'}, not shard {self.shard.index}")
        if meta.numel != self._numels[block_id]:
            raise InvalidArgument(f"block {block_id}: numel {meta.numel}, but the mapping table gives it "
                                  f"{self._numels[block_id]} elements")
        if meta.num_workers != self._num_workers:
            raise InvalidArgument(f"block {block_id}: num_workers {meta.num_workers}, but job {self.config.job} has "
                                  f"{self._num_workers} workers")

    @_unary
    async def OpenChannel(self, request: ps_pb2.ChannelRequest, context: Context) -> ps_pb2.ChannelReply:
        """The data channel's port and the token of (worker, generation) its connections must carry."""
        what = f"OpenChannel of worker {request.worker}"
        if self.channel is None:
            raise FailedPrecondition(f"{what}: shard {self.shard.index} serves no data channel (--data-port -1): "
                                     "run the workers with --data-path grpc")
        self._check_identity(context, request.worker, what)
        self.shard.check_generation(request.generation, what)
        if request.worker >= self.shard.max_workers:
            raise InvalidArgument(f"{what}: worker outside 0..{self.shard.max_workers - 1}")
        return ps_pb2.ChannelReply(port=self.channel.port, token=self.channel.token(request.worker,
                                                                                    request.generation),
                                   idle_s=self.config.stream_idle_s, tls=self.channel.tls is not None)

    @_unary
    async def InitBlock(self, request_iterator: AsyncIterator[ps_pb2.InitBlockChunk], context: Context
                        ) -> ps_pb2.InitBlockReply:
        request_iterator = Progressing(request_iterator, self.config.stream_idle_s, "InitBlock",
                                       self.config.stream_min_bytes_per_s)
        spec = await first_part(request_iterator, "spec", "InitBlock")
        meta = BlockMeta(spec.block_id, dtype_name(spec.dtype, f"InitBlock {spec.block_id}"), spec.numel,
                         spec.num_workers, optimizer_from_proto(spec.optimizer), tuple(spec.segments),
                         spec.compression)
        await asyncio.to_thread(self.shard.check_meta, meta)  # off the loop: it builds and steps the optimizer
        await self._check_owner(meta)
        self.shard.check_existing(meta)  # all before a byte of its data is read
        init = await receive_exact(data_parts(request_iterator, f"InitBlock {meta.block_id}"), meta.numel,
                                    f"InitBlock {meta.block_id}")
        created, round_ = self.shard.create_block(meta, init)
        return ps_pb2.InitBlockReply(block_id=meta.block_id, created=created, round=round_)

    def _check_identity(self, context: Context, worker: int, what: str) -> None:
        """Strict worker identity: the client's certificate must name ``worker``."""
        if self.config.tls_worker_identity:
            require_worker(_certificate_names(context), worker, what)

    @_unary
    async def Push(self, request_iterator: AsyncIterator[ps_pb2.PushChunk], context: Context) -> ps_pb2.PushReply:
        stream = Progressing(request_iterator, self.config.stream_idle_s, "Push", self.config.stream_min_bytes_per_s)
        segments, results = Segments(stream), []
        try:
            while (header := await segments.next_header()) is not None:
                what = f"push of block {header.block_id} by worker {header.worker}"
                self._check_identity(context, header.worker, what)
                duplicate, pushed = await self.shard.push(push_of(header), ChunkStream(segments.data(), stream),
                                                           stream, context.peer())
                results.append(ps_pb2.BlockPushResult(block_id=header.block_id, duplicate=duplicate,
                                                      pushed=pushed))
        except IMergeError:  # refused: let the client finish writing, so that it reads this refusal
            with contextlib.suppress(Exception):  # a stream that breaks meanwhile: the refusal is still the answer
                await segments.drain(PUSH_DRAIN_BYTES)
            raise
        return ps_pb2.PushReply(results=results)

    def _pull_timeout(self, request: ps_pb2.PullRequest, context: Context) -> float:
        timeout = self.config.pull_wait(request.timeout_s)
        remaining = context.time_remaining()
        if remaining is not None:  # answer with our own message before the caller's deadline
            timeout = min(timeout, max(remaining - 0.2, 0.01))
        return timeout

    async def _send(self, blocks: list[tuple[str, int, Snapshot, tuple[bool, float]]]
                    ) -> AsyncIterator[ps_pb2.TensorChunk | bytes]:
        for block_id, round_, snapshot, result in blocks:
            yield ps_pb2.TensorChunk(meta=tensor_meta(block_id, round_, snapshot.dtype, snapshot.numel,
                                                      snapshot.nnz, result))
            for frame in snapshot.frames:  # encoded TensorChunk data messages, sent as they are
                yield frame
            self.shard.counters.bytes_sent += snapshot.nbytes

    @_streaming
    async def Pull(self, request: ps_pb2.PullRequest, context: Context) -> AsyncIterator[ps_pb2.TensorChunk | bytes]:
        """Each block is sent as soon as its round completes (pipelined), not when all of them have."""
        check_block_ids(request.block_ids, len(self.shard.blocks), "Pull")
        self._check_identity(context, request.worker, "Pull")
        timeout = self._pull_timeout(request, context)
        peer, parked = context.peer(), len(request.block_ids)
        most = max(PARKED_PULLS_PER_BLOCK * len(self.shard.blocks), MIN_PARKED_PULLS)
        if self._parked[peer] + parked > most:
            raise ResourceExhausted(f"Pull: {self._parked[peer]} block waits are parked on this connection already "
                                    f"(at most {most})")
        self._parked[peer] += parked
        try:  # the blocks completed together go out in the order they were asked for
            async with contextlib.aclosing(self.shard.pull_blocks(request.block_ids, request.worker, request.round,
                                                                   timeout, request.generation)) as pulled:
                async for blocks in pulled:
                    async for chunk in self._send(blocks):
                        yield chunk
        finally:
            self._parked[peer] -= parked
            if not self._parked[peer]:
                del self._parked[peer]

    @_streaming
    async def Fetch(self, request: ps_pb2.FetchRequest, context: Context) -> AsyncIterator[ps_pb2.TensorChunk | bytes]:
        check_block_ids(request.block_ids, len(self.shard.blocks), "Fetch")
        replies = [self.shard.fetch(block_id, request.generation) for block_id in request.block_ids]
        async for chunk in self._send([(b, r, s, (False, 0.0)) for b, (r, s) in zip(request.block_ids, replies)]):
            yield chunk

    @_streaming
    async def Export(self, request: ps_pb2.ExportRequest, context: Context
                     ) -> AsyncIterator[ps_pb2.BlockStateChunk]:
        """Only worker 0 (imerge.save); at most MAX_EXPORTS at once, since a reply the client does not read holds
        the block's state it is sending."""
        check_block_ids(request.block_ids, len(self.shard.blocks), "Export")
        self._check_loader(context, "Export")
        if self._exports >= MAX_EXPORTS:
            raise ResourceExhausted(f"Export: {self._exports} exports are in flight already (at most {MAX_EXPORTS})")
        self._exports += 1
        try:
            async for chunk in self._export(request):
                yield chunk
        finally:
            self._exports -= 1

    async def _export(self, request: ps_pb2.ExportRequest) -> AsyncIterator[ps_pb2.BlockStateChunk]:
        for block_id in request.block_ids:
            round_, data = self.shard.export_block(block_id, request.generation)
            yield ps_pb2.BlockStateChunk(meta=ps_pb2.BlockStateMeta(block_id=block_id, round=round_,
                                                                    nbytes=len(data),
                                                                    generation=request.generation))
            for start in range(0, len(data), CHUNK_BYTES):
                yield ps_pb2.BlockStateChunk(data=data[start:start + CHUNK_BYTES])

    @_unary
    async def Import(self, request_iterator: AsyncIterator[ps_pb2.BlockStateChunk], context: Context
                     ) -> ps_pb2.ImportReply:
        """Only worker 0, during an imerge.load it announced; every block's state is bounded when its meta arrives
        and checked whole before any is applied, all at once."""
        self._check_loader(context, "Import")
        stream = Progressing(request_iterator, self.config.stream_idle_s, "Import",
                             self.config.stream_min_bytes_per_s)
        generation, states = await receive_states(stream, self.shard.import_bound, self._check_load_expected)
        self.shard.import_blocks(states, generation)
        return ps_pb2.ImportReply(block_ids=list(states))

    def _check_loader(self, context: Context, what: str) -> None:
        if self.config.tls_worker_identity:
            require_loader(_certificate_names(context), what)

    async def _check_load_expected(self, generation: int) -> None:
        """An Import comes only while worker 0 runs imerge.load: it announces the load in the store first."""
        if self.store is None:
            return
        if not await asyncio.to_thread(self.store.loading, generation):
            raise FailedPrecondition(f"Import: no imerge.load of generation {generation} is in progress (worker 0 "
                                     "announces one before it imports): a state is imported only by imerge.load")

    @_unary
    async def Stats(self, request: ps_pb2.StatsRequest, context: Context) -> ps_pb2.StatsReply:
        c = self.shard.counters
        blocks = [ps_pb2.BlockStats(block_id=b.meta.block_id, numel=b.meta.numel, round=b.round,
                                    pushed=len(b.rounds.pushed), num_workers=b.meta.num_workers)
                  for b in self.shard.blocks.values()]
        return ps_pb2.StatsReply(shard_index=self.shard.index, blocks=blocks, bytes_received=c.bytes_received,
                                 bytes_sent=c.bytes_sent, pushes=c.pushes, duplicate_pushes=c.duplicate_pushes,
                                 pulls=c.pulls, rounds_completed=c.rounds_completed, rejected=c.rejected)


class ShardServer:
    """One shard: the gRPC server, its health service and its registration."""

    def __init__(self, config: PSConfig):
        self.config = config
        self.shard = Shard(config.shard_index, check_finite=config.check_finite,
                           max_block_numel=config.max_block_numel, max_workers=config.max_workers,
                           link_mbps=config.link_mbps, threads=config.threads,
                           plane=data_plane(config.data_plane))
        self.address = ""
        self.metrics: MetricsServer | None = None
        self._server: grpc.aio.Server | None = None
        self._store: ShardStore | None = None
        self._membership: ShardMembership | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # health imports aio untyped
        self._channel: DataChannel | None = None
        self.shard.checkpoint_every = config.checkpoint_every

    @property
    def channel(self) -> DataChannel | None:
        """The data channel while the shard serves one."""
        return self._channel

    async def start(self) -> str:
        cfg = self.config
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._store = ShardStore(cfg.redis_url, cfg.job) if cfg.register else None
        servicer = ParameterServerServicer(self.shard, cfg, self._store)
        self.shard.agreements.exchange = servicer.exchange
        self._server.add_generic_rpc_handlers((method_handlers(servicer),))
        self._server.add_generic_rpc_handlers((method_handlers(HealthGate(self._health), health_pb2, "Health"),))
        listen = f"{cfg.host}:{cfg.port}"
        problem = bind_problem(cfg.host, cfg.port)
        if problem:  # checked first: gRPC's own failure also prints a line of its C core to stderr
            raise ConfigError("--port", f"shard {cfg.shard_index} cannot listen on {listen}: {problem}")
        try:
            port = (self._server.add_secure_port(listen, server_credentials(cfg)) if cfg.tls_server
                    else self._server.add_insecure_port(listen))
        except RuntimeError:  # grpc's "Failed to bind to address"
            port = 0
        if port == 0:
            raise ConfigError("--port", f"shard {cfg.shard_index} cannot listen on {listen} (the address is in use or "
                              "not this host's; --port 0 picks a free port)")
        await self._server.start()
        report_port(cfg.ports_file, "grpc", port)
        if cfg.data_port >= 0:
            self._channel = DataChannel(self.shard, cfg, asyncio.get_running_loop(),
                                        server_ssl_context(cfg) if cfg.tls_server else None)
            servicer.attach_channel(self._channel)
            try:
                report_port(cfg.ports_file, "data", self._channel.start())
                self.shard.on_restored = self._channel.end_generations_before
            except OSError as exc:
                raise ConfigError("--data-port", f"shard {cfg.shard_index} cannot listen on "
                                                  f"{cfg.host}:{cfg.data_port}: {exc}") from None
        self.metrics = MetricsServer(self.shard.metrics.registry, cfg.metrics_port, f"shard {cfg.shard_index}",
                                     cfg.metrics_address(cfg.host), ports_file=cfg.ports_file)
        self.address = cfg.advertise or f"{cfg.host}:{port}"
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self._store is not None:
            await asyncio.to_thread(self._store.check_job, cfg.job_token, f"shard {cfg.shard_index}")
            self.shard.issued_tokens = IssuedTokens(self._store.clock_us)
            self._membership = ShardMembership(self._store, self.shard, servicer.load_plan,
                                               asyncio.get_running_loop(), cfg.heartbeat_ttl_s,
                                               cfg.checkpoint_failures)
            await self._membership.join()
            await asyncio.to_thread(self._store.register_shard, cfg.shard_index, self.address)
            self._membership.start()
        log.info("shard %d serving on %s (%s)%s, %s data plane", cfg.shard_index, self.address,
                 ("mutual TLS" if cfg.tls_ca else "TLS") if cfg.tls_server else "plaintext",
                 f", data channel on port {self._channel.port}" if self._channel is not None else "",
                 self.shard.plane.name)
        return self.address

    async def drain(self) -> None:
        """On SIGTERM: keep serving until the blocks reach a common round, checkpoint it, within the grace.

        The shard leaves the job first (no heartbeat, no new generations), so the job recovers without it.
        """
        if self._membership is not None:
            await asyncio.to_thread(self._membership.stop)
            self._membership = None
        try:
            round_ = await asyncio.wait_for(self.shard.final_checkpoint(), self.config.grace_s)
        except asyncio.TimeoutError:
            log.warning("shard %d: the blocks reached no common round within %.1fs; the last periodic checkpoint "
                        "stands", self.config.shard_index, self.config.grace_s)
            return
        if round_ is not None:
            log.info("shard %d: final checkpoint at round %d", self.config.shard_index, round_)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving (in-flight calls get ``grace_s``) and release everything."""
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
            self._server = None
        if self._channel is not None:
            self._channel.stop()
            self._channel = None
        if self._membership is not None:
            await asyncio.to_thread(self._membership.stop)
            self._membership = None
        if self.metrics is not None:
            self.metrics.close()
        if self._store is not None:
            self._store.close()
        await self.shard.end_rounds()
        self.shard.close()



async def serve(config: PSConfig) -> int:
    """Run a shard until SIGTERM or SIGINT, then stop gracefully."""
    # Blocks are summed and stepped on --threads threads at once, each step on one core: a block's arithmetic
    # split across torch's threads took the same time and twice the CPU (a 233k-element block: 0.75 ms of CPU
    # on one thread, 1.3-2.4 ms on two).
    torch.set_num_threads(1)
    keep_freed_memory()  # a round's large buffers come back every round: their pages stay (core/memory.py)
    apply_thread_policy(config.thread_policy, f"shard {config.shard_index}", whole_process=True)  # the rest inherit
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    server = ShardServer(config)
    try:
        await server.start()
    except BaseException:  # e.g. Redis refused the registration: close the server before the loop closes
        await server.stop(0)
        raise
    await stopping.wait()
    log.info("shard %d stopping: draining until a final checkpoint, for up to %.1fs", config.shard_index,
             config.grace_s)
    await server.drain()
    await server.stop(1.0)
    return 0


class ThreadedShard:
    """A shard served from a background thread's event loop (tests, embedding), under ``--thread-policy``
    (the threads it starts inherit it; the embedding process's own threads keep theirs)."""

    def __init__(self, config: PSConfig):
        self.server = ShardServer(config)
        self._loop = asyncio.new_event_loop()
        self._thread = thread_under(config.thread_policy, self._loop.run_forever, f"shard-{config.shard_index}")
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(30)

    @property
    def shard(self) -> Shard:
        return self.server.shard

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
