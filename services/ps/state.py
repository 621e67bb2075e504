"""The shard: its blocks (:mod:`.block`) and the round protocol, independent of gRPC.

What a round is (which push counts, a retry, a fence, the round's options, when it aggregates, publishes or
fails) is decided by each block's :class:`~imerge.core.blockround.BlockRound`, a pure kernel the simulator runs
too; this module carries out its actions on the block's data, the step threads and the waiting pulls.

A push stores one worker's gradient of a round in the block's row for it;
every push of a round carries the same options (:mod:`.rounds`: the
hyperparameters an LR schedule changed, an assignment, a loss scale, a max
norm), and one that disagrees is refused. The last push of a round starts the
aggregation; a round that clips or unscales waits until every block of the
job has averaged (the shards agree on the scalars), then steps. A pull waits
for the round it names.

Every request carries the job generation; one of an older generation is
rejected before anything is applied. A push made under a slot flag carries
the flag's fencing token; a token older than one the block has already seen
is a holder whose lease passed to another while it was paused, and is
rejected with ABORTED (take the flag again and retry). Every
``checkpoint_every`` rounds, when all of the shard's blocks have completed
the same round, their images are copied and written to disk in the
background; :meth:`Shard.restore` swaps a checkpoint in for a new
generation and fails the pulls that were waiting on the old one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from imerge.control.messages import RoundScalars
from imerge.core.blockstate import block_state_bytes, parse_block_state, state_bytes_bound
from imerge.core.codec import digest, tensor_view
from imerge.core.compression import all_finite
from imerge.core.blockround import Action, Aggregate, Counted, Receive, Retry
from imerge.core.rounds import Push
from imerge.core.modes import payload_bytes
from imerge.core.native import DataPlane, data_plane
from imerge.core.errors import AlreadyExists, FailedPrecondition, Fenced, InvalidArgument, Unavailable
from imerge.core.limits import check_id, clip

from .block import BlockMeta, BlockState, Snapshot
from .payloads import PayloadSource, check_encoding, receive_copy, receive_gradient, same_payload
from .checkpoint import BlockImage, Checkpoint, CheckpointStore
from .fencing import IssuedTokens
from .metrics import ShardCounters, ShardMetrics
from .pulls import Pulls
from .rounds import Agreements

log = logging.getLogger(__name__)
T = TypeVar("T")
QUEUED_CHECKPOINTS = 2  # checkpoints being written or waiting to be, at most: a due one waits rather than
# being skipped (a shard that skipped a round its peers wrote, then evicted, left no round common to all
# shards when rounds came faster than a write: no recovery), unless two are already ahead of it
CLOSE_STEPS_S = 10.0  # how long a stopping shard waits for the blocks' steps still running


class Shard(Pulls):
    def __init__(self, index: int, *, check_finite: bool = True, max_block_numel: int = 1 << 28,
                 max_workers: int = 4096, link_mbps: float = 10000.0, threads: int = 0,
                 plane: DataPlane | None = None):
        self.index = index
        self.plane = plane or data_plane()  # receives the payloads and sums the rows (native where built)
        self.check_finite = check_finite
        self.max_block_numel = max_block_numel
        self.max_workers = max_workers
        self.blocks: dict[str, BlockState] = {}
        self.counters = ShardCounters()
        self.metrics = ShardMetrics(index, self.counters, link_mbps)
        self._executor = concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 2,
                                                               thread_name_prefix=f"ps{index}-step")
        self._arithmetic_slots = threads or os.cpu_count() or 2
        self._arithmetic = threading.BoundedSemaphore(self._arithmetic_slots)
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.generation = 0
        self.expected: set[str] | None = None  # the blocks the mapping table gives this shard
        self.checkpoints: CheckpointStore | None = None
        self.checkpoint_every = 0
        self.on_checkpoint: Callable[[list[int]], None] | None = None  # called with the complete rounds
        # the round every shard holds complete as they published it (None: none, or unknown): kept by the prune
        self.held_in_common: Callable[[], int | None] = lambda: None
        self.on_checkpoint_failed: Callable[[int, str, int], None] | None = None  # (round, why, failures in a row)
        self.on_restored: Callable[[int], None] | None = None  # called with the new generation after a restore
        self.failed_checkpoints = 0  # consecutive failed writes
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ps{index}-checkpoint")
        self._writes: list[concurrent.futures.Future[None]] = []  # the checkpoints submitted and not seen written
        self._last_checkpoint = -1
        self._final: asyncio.Future[None] | None = None  # a final checkpoint awaited at the next common round
        self._final_written = False
        self.agreements = Agreements()  # rounds whose step waits for scalars of every block (the server exchanges)
        self.issued_tokens: IssuedTokens | None = None  # the store's clock, which bounds the fencing tokens
        self.round_traces: dict[str, list[dict[str, Any]]] | None = None  # block id -> its rounds' trace, if asked

    def _trace_of(self, block_id: str) -> list[dict[str, Any]] | None:
        """A new trace of the block's rounds where traces are asked for (a test's view: core.blockround.replay)."""
        if self.round_traces is None:
            return None
        self.round_traces[block_id] = []
        return self.round_traces[block_id]

    async def end_rounds(self) -> None:
        """The shard stops: the aggregations still in flight on the event loop (a round waiting for the shards'
        agreement that no longer comes) end now, not as tasks destroyed pending when the loop closes."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop stepping, and wait for the steps still running: a data connection's thread inside torch when the
        interpreter finalizes would end there and abort the process (the step threads are joined at exit)."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        deadline = time.monotonic() + CLOSE_STEPS_S
        for _ in range(self._arithmetic_slots):  # every slot taken: no step runs, none starts
            if not self._arithmetic.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                log.warning("shard %d: a block's step still runs %gs after the shard stopped", self.index,
                            CLOSE_STEPS_S)
                return

    # -- checkpoints -------------------------------------------------------------
    def common_round(self) -> int | None:
        """The round every expected block has completed, if they all exist and agree."""
        if self.expected is None or set(self.blocks) != self.expected or not self.blocks:
            return None
        rounds = {block.round for block in self.blocks.values()}
        return rounds.pop() if len(rounds) == 1 else None

    def maybe_checkpoint(self, final: bool = False) -> concurrent.futures.Future[None] | None:
        """Start writing a checkpoint if the blocks are at a common round due for one (or ``final``)."""
        round_ = self.common_round()
        if self.checkpoints is None or round_ is None or round_ <= self._last_checkpoint:
            return None
        if not final and (self._final_written or not self._checkpoint_due(round_)):
            return None  # after a final checkpoint none follows: a later one would evict the round the other
            # shards hold in common with this one, while the draining shard still answers in-flight calls
        self._writes = [write for write in self._writes if not write.done()]
        if len(self._writes) >= QUEUED_CHECKPOINTS and not final:
            log.warning("shard %d: checkpoint of round %d skipped: %d earlier ones are still being written",
                        self.index, round_, len(self._writes))
            return None
        self._last_checkpoint = round_
        images = [self.blocks[block_id].image() for block_id in sorted(self.blocks)]
        writing = self._writer.submit(self._write_checkpoint, self.checkpoints, round_, images)
        self._writes.append(writing)  # written in order, after those before it
        return writing

    async def final_checkpoint(self) -> int | None:
        """Write a checkpoint at the blocks' next common round (now, if they agree); return that round.

        None when no checkpoint folder is configured. Used on SIGTERM: the workers keep training while
        the shard waits, so the current round completes and the checkpoint loses no finished round.
        """
        if self.checkpoints is None:
            return None
        if self.common_round() is None:
            self._final = asyncio.get_running_loop().create_future()
            await self._final
        round_ = self.common_round()
        self.maybe_checkpoint(final=True)
        self._final_written = True
        if self._writes:  # the one just submitted, else the last one before it (they are written in order)
            await asyncio.wrap_future(self._writes[-1])
        return round_

    def _write_checkpoint(self, store: CheckpointStore, round_: int, images: list[BlockImage]) -> None:
        try:
            with self.metrics.checkpoint_write.time():
                store.write(round_, images, self.held_in_common())
        except Exception as exc:  # noqa: BLE001 - a failed write leaves the previous checkpoint in place
            self.counters.checkpoint_failures += 1
            self.failed_checkpoints += 1
            reason = f"{type(exc).__name__}: {exc}"
            log.error("shard %d: checkpoint of round %d failed (%d in a row; the checkpoint of round %s stands): %s",
                      self.index, round_, self.failed_checkpoints, max(store.rounds(), default=None),
                      reason)
            if self.on_checkpoint_failed is not None:
                self.on_checkpoint_failed(round_, reason, self.failed_checkpoints)
            return
        self.failed_checkpoints = 0
        self.counters.checkpoints_written += 1
        self.metrics.checkpoint_round.set(round_)
        if self.on_checkpoint is not None:
            self.on_checkpoint(store.rounds())

    def load_checkpoint(self, round_: int) -> Checkpoint:
        if self.checkpoints is None:
            raise FailedPrecondition(f"shard {self.index} has no checkpoint folder (--checkpoint-dir)")
        return self.checkpoints.read(round_)

    async def restore(self, generation: int, checkpoint: Checkpoint) -> None:
        """Serve ``generation`` from ``checkpoint``: the old blocks' waiting pulls fail, pushes go nowhere."""
        if self.expected is not None and set(checkpoint.blocks) != self.expected:
            raise FailedPrecondition(f"checkpoint {checkpoint.path} holds blocks {sorted(checkpoint.blocks)}, "
                                     f"the mapping table gives shard {self.index} {sorted(self.expected)}")
        old = self.blocks
        self.blocks = {block_id: BlockState.from_image(image, checkpoint.round, self.plane, self._trace_of(block_id))
                       for block_id, image in checkpoint.blocks.items()}
        self.agreements.reset()  # rounds of the old generation never complete
        self.generation = generation
        self._last_checkpoint = checkpoint.round
        self.metrics.generation.set(generation)
        self.metrics.blocks.set(len(self.blocks))
        for block in old.values():
            block.rounds.supersede(generation)
            block.wake()
        log.info("shard %d: generation %d restored from round %d (%s)", self.index, generation, checkpoint.round,
                 checkpoint.path)
        if self.on_restored is not None:
            self.on_restored(generation)

    # -- validation (before any allocation) ---------------------------------
    def check_meta(self, meta: BlockMeta) -> None:
        check_id(meta.block_id, "InitBlock")
        if meta.dtype != "float32":
            raise InvalidArgument(f"block {meta.block_id}: dtype {meta.dtype} is not supported (float32 only)")
        if not 0 < meta.numel <= self.max_block_numel:
            raise InvalidArgument(f"block {meta.block_id}: numel {meta.numel} outside 1..{self.max_block_numel}")
        if not 0 < meta.num_workers <= self.max_workers:
            raise InvalidArgument(f"block {meta.block_id}: num_workers {meta.num_workers} "
                                  f"outside 1..{self.max_workers}")
        meta.optimizer.validate(step=True)  # the shard steps it anyway: what the step refuses is refused now
        try:
            meta.mode  # noqa: B018 - the wire's name parsed once, here
        except InvalidArgument as exc:
            raise InvalidArgument(f"block {meta.block_id}: {exc}") from None
        if meta.segments and (min(meta.segments) < 1 or sum(meta.segments) != meta.numel):
            raise InvalidArgument(f"block {meta.block_id}: segments of {sum(meta.segments)} elements (each at least "
                                  f"1) do not make up its {meta.numel} elements")

    # -- init -----------------------------------------------------------------
    def check_existing(self, meta: BlockMeta) -> None:
        """Refuse a spec that differs from the block's, if it exists (before its data is read)."""
        existing = self.blocks.get(meta.block_id)
        if existing is not None and existing.meta != meta:
            raise AlreadyExists(f"block {meta.block_id} exists with a different spec: "
                                f"{clip(str(existing.meta), 400)} vs {clip(str(meta), 400)}")

    def create_block(self, meta: BlockMeta, init: torch.Tensor) -> tuple[bool, int]:
        """First writer wins; an identical init is accepted, a different one rejected."""
        init_digest = digest(tensor_view(init))
        existing = self.blocks.get(meta.block_id)
        if existing is None:
            self.blocks[meta.block_id] = BlockState(meta, init, init_digest, self.plane,
                                                    trace=self._trace_of(meta.block_id))
            self.metrics.blocks.set(len(self.blocks))
            log.info("block %s: %d elements, %d workers, %s", meta.block_id, meta.numel,
                     meta.num_workers, meta.optimizer.name)
            self.maybe_checkpoint()  # round 0, once every block exists
            return True, 0
        self.check_existing(meta)
        if existing.init_digest != init_digest:
            raise AlreadyExists(f"block {meta.block_id} exists with different initial parameters")
        return False, existing.round

    # -- push -----------------------------------------------------------------
    async def push(self, push: Push, data: PayloadSource, stream: Any = None, source: str = "") -> tuple[bool, int]:
        """Receive one worker's gradient for a round; return (duplicate, workers pushed so far).

        Pushes of the same (block, worker) are serialized by a lock, so a malformed push never blocks or spoils a
        good one; the block's round decides what the push is (:meth:`BlockRound.offer`): a repeat of a counted push
        is acknowledged as a duplicate if it carries the same bytes (a retry), and refused with AlreadyExists if it
        does not (a second writer: two clients push as one worker; ``source``, the client's address, names both).
        The payload's encoding must be the one the block's compression mode makes (dense fp32 for an assignment).
        ``stream`` (a :class:`~.streams.Progressing`) is superseded when a newer push of the same worker comes for
        the row."""
        block, nbytes = self.pushed_block(push), payload_bytes(push.numel, push.dtype, push.nnz)
        data.declare(nbytes, push.what)  # a retry too: before it holds the row
        async with block.rows[push.worker].held(push.round, stream, push.what, lambda: block.round):
            action = self.offer(block, push)
            if isinstance(action, Retry):
                await self._check_retry(block, push, action, data, source)
                self.counters.duplicate_pushes += 1
                return True, len(block.rounds.pushed)
            if action.new_token:
                await self._check_token(push)
            await self._receive(block, push, data)
            return False, self.carry_out(block, block.rounds.counted(push, source), nbytes)

    def pushed_block(self, push: Push) -> BlockState:
        """The block ``push`` is for, once the push's generation, worker, size, encoding, pieces and hyperparameters
        are checked."""
        check_id(push.block_id, "Push")
        self.check_generation(push.generation, push.what)
        block = self.block(push.block_id)
        self._check_worker(block, push.worker)
        if push.numel != block.meta.numel:
            raise InvalidArgument(f"{push.what}: got {push.numel} elements, the block holds {block.meta.numel}")
        check_encoding(block.meta, push.options.assign, push.dtype, push.nnz, push.what)
        block.check_push(push)
        return block

    def offer(self, block: BlockState, push: Push) -> Retry | Receive:
        try:
            return block.rounds.offer(push)
        except Fenced:
            self.counters.fenced_pushes += 1
            raise

    async def _check_token(self, push: Push) -> None:
        """A fencing token newer than any the block has seen must have been issued by the store's clock."""
        clock_us = await self.issued_tokens.unissued(push.fence) if self.issued_tokens is not None else None
        if clock_us is not None:
            raise InvalidArgument(f"{push.what}: slot flag token {push.fence} is ahead of the store's clock "
                                  f"({clock_us} µs), which issues every token: no flag gave it")

    async def _receive(self, block: BlockState, push: Push, data: PayloadSource) -> None:
        """The payload into the worker's row (the row no longer holds the round counted before), checked finite."""
        with self.receiving(block, push) as check:
            received, finite = await receive_gradient(block, push.worker, push.dtype, push.nnz, data, push.what,
                                                      check)
            if check and not (all_finite(received) if finite is None else finite):
                raise InvalidArgument(f"{push.what}: gradient holds NaN or infinity")

    @contextlib.contextmanager
    def receiving(self, block: BlockState, push: Push) -> Iterator[bool]:
        """While ``push``'s payload goes into its row: whether its values must be checked finite; a payload that
        does not arrive whole and checked leaves the push uncounted."""
        block.rounds.receive_started(push)
        self.metrics.pushes_in_flight.inc()
        try:
            yield self.check_finite and not push.options.loss_scale
        except BaseException:
            block.rounds.abandoned(push)
            raise
        finally:
            self.metrics.pushes_in_flight.dec()

    def token_known(self, token: int) -> bool:
        """Whether a new fencing token is within the store's clock as the shard last read it (no read needed)."""
        return self.issued_tokens is None or self.issued_tokens.known(token)

    async def _check_retry(self, block: BlockState, push: Push, retry: Retry, data: PayloadSource,
                           source: str) -> None:
        """A push of a row already counted: a retry must carry the bytes that were counted."""
        worker, what = push.worker, push.what
        if retry.counted_round != push.round:  # the row no longer holds that round (restored since): nothing to compare
            await data.skip()
            return
        if same_payload(block, worker, await receive_copy(block, push.dtype, push.nnz, data, what)):
            return
        self.counters.second_writers += 1
        message = (f"{what} from {source or 'a client'}: worker {worker}'s row of that round already holds "
                   f"different data, pushed by {retry.counted_source or 'another client'}: two clients push as "
                   f"worker {worker} (a retry carries the same bytes); the push that came first was counted")
        log.error("shard %d: second writer: %s", self.index, message)
        raise AlreadyExists(message)

    def carry_out(self, block: BlockState, actions: list[Action], nbytes: int,
                  start: Callable[[BlockState, Aggregate], None] | None = None) -> int:
        """A counted push's actions: count it; start the aggregation when it was the last one (``start``: how,
        from a thread that is not the event loop's). The workers pushed so far."""
        pushed = 0
        for action in actions:
            if isinstance(action, Counted):
                pushed = action.pushed
                self.counters.add(pushes=1, bytes_received=nbytes)
            elif isinstance(action, Aggregate):
                (start or self.start_aggregate)(block, action)
        return pushed

    def start_aggregate(self, block: BlockState, round_: Aggregate) -> None:
        """On the event loop: average and step the block's round (its pulls are answered when it is done)."""
        task = asyncio.get_running_loop().create_task(self._aggregate(block, round_))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _aggregate(self, block: BlockState, round_: Aggregate) -> None:
        options, no_grad = round_.options, round_.no_grad
        loop = asyncio.get_running_loop()
        try:
            if options.needs_agreement:  # every block of the job must have averaged before any steps
                mean, scalars = await loop.run_in_executor(self._executor, self.run_arithmetic, block.average,
                                                           self.metrics, options)
                agree = block.rounds.averaged(round_.round, scalars.sumsq, scalars.found_inf)
                total = await self.agreements.agree(round_.round, block.meta.block_id, RoundScalars(*agree.scalars),
                                                    self.expected or set(self.blocks))
                step = block.rounds.agreed(round_.round, total.sumsq, total.found_inf)
                snapshot = await loop.run_in_executor(self._executor, self.run_arithmetic, block.step, self.metrics,
                                                      mean, options, no_grad, RoundScalars(*step.total))
            else:  # one trip to a step thread
                snapshot = await loop.run_in_executor(self._executor, self.run_arithmetic, block.aggregate,
                                                      self.metrics, options, no_grad)
        except Exception as exc:  # noqa: BLE001 - the round's pulls fail with it
            self._round_failed(block, round_, exc)
            return
        self._published(block, round_, snapshot)

    def aggregate_here(self, block: BlockState, round_: Aggregate, on_loop: Callable[..., None]) -> None:
        """On a data connection's thread, which counted the round's last push: average and step a round that
        needs no agreement right here (at most --threads at once), then answer its pulls. A round that may
        complete a checkpoint's round is published by the event loop (``on_loop(function, *args)``), which
        copies the blocks' images before any pull of it is answered (no block can step past it meanwhile)."""
        try:
            snapshot = self.run_arithmetic(block.aggregate, self.metrics, round_.options, round_.no_grad)
        except Exception as exc:  # noqa: BLE001 - the round's pulls fail with it
            self._round_failed(block, round_, exc)
            return
        if self.checkpoints is not None and (self._checkpoint_due(round_.round + 1) or self._final_awaited()):
            on_loop(self._published, block, round_, snapshot)
            return
        self._published(block, round_, snapshot, checkpoint=False)
        if self._final_awaited():  # asked for after the look above: the loop's look may have missed this round
            on_loop(self.after_round, block)

    def _checkpoint_due(self, round_: int) -> bool:
        """Whether the blocks reaching ``round_`` make a periodic checkpoint due (--checkpoint-every)."""
        return round_ % max(self.checkpoint_every, 1) == 0

    def _final_awaited(self) -> bool:
        final = self._final
        return final is not None and not final.done()

    def run_arithmetic(self, arithmetic: Callable[..., T], *args: Any) -> T:
        """A block's averaging or step, at most --threads at once (the step threads and the connections')."""
        if self._closed:
            raise Unavailable(f"shard {self.index} stopped")
        with self._arithmetic:
            return arithmetic(*args)

    def _round_failed(self, block: BlockState, round_: Aggregate, exc: Exception) -> None:
        log.error("shard %d: block %s: round %d cannot complete: %s", self.index, block.meta.block_id, round_.round,
                  exc)
        block.rounds.failed(round_.round, f"round {round_.round} could not complete on shard {self.index}: {exc}")
        block.wake()

    def _published(self, block: BlockState, round_: Aggregate, snapshot: Snapshot, checkpoint: bool = True) -> None:
        """The round stepped: its pulls are answered; ``checkpoint`` (on the event loop): a checkpoint of the
        blocks as they are now, if one is due, before any pull of the round is answered. A round a checkpoint
        is due at waits until the previous checkpoint is on disk: no shard gets more than one checkpoint ahead
        of what it has written, so the shards (a round apart at most) always hold a common round among the
        --checkpoint-keep newest, however fast the rounds and slow the disk."""
        unwritten = [write for write in self._writes if not write.done()] if checkpoint else []
        if unwritten and self._checkpoint_due(round_.round + 1):
            loop = asyncio.get_running_loop()

            def written(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: the shard stopped
                    loop.call_soon_threadsafe(self._published, block, round_, snapshot)

            unwritten[-1].add_done_callback(written)
            return
        block.snapshot = snapshot  # before the round completes: a pull that sees the round sends this snapshot
        block.rounds.completed(round_.round)
        self.counters.add(rounds_completed=1)
        if checkpoint:
            self.after_round(block)
        block.wake()

    def after_round(self, block: BlockState) -> None:
        """On the event loop, once a round of ``block`` completed: a checkpoint, if one is due."""
        if self.blocks.get(block.meta.block_id) is block:  # not replaced by a restore meanwhile
            if self._checkpoint_due(block.round):  # the blocks' common round, if they have one: no look at all
                self.maybe_checkpoint()            # of them after every round of every block
            if self._final is not None and not self._final.done() and self.common_round() is not None:
                self._final.set_result(None)

    def export_block(self, block_id: str, generation: int = 0) -> tuple[int, bytes]:
        """(round, the block's parameters and optimizer state as safetensors bytes)."""
        self.check_generation(generation, f"export of block {block_id}")
        image = self.block(block_id).image()
        return self.block(block_id).round, block_state_bytes(image.param, image.state)

    def import_bound(self, block_id: str, generation: int) -> int:
        """The most bytes an Import of ``block_id`` may carry (NotFound, StaleGeneration before any is read)."""
        self.check_generation(generation, f"import of block {clip(block_id)}")
        block = self.block(block_id)
        return state_bytes_bound(block.meta.numel, len(block.meta.pieces), block.state_layout)

    def import_blocks(self, states: dict[str, bytes], generation: int) -> None:
        """Replace the blocks' parameters and optimizer state, all or none: every state is checked against its
        block, and no worker may have pushed any of the blocks' current rounds, before the first is applied."""
        self.check_generation(generation, f"import of blocks {sorted(states)}")
        parsed = {}
        for block_id, data in states.items():
            block = self.block(block_id)
            parsed[block_id] = parse_block_state(data, block.meta.numel, block.meta.pieces,
                                                 f"import of block {block_id}", block.state_layout)
        busy = {block_id: workers for block_id in states if (workers := self.blocks[block_id].rounds.busy())}
        if busy:
            raise FailedPrecondition(f"import: workers already pushed the current round of blocks {busy}: load at "
                                     "the same point of the loop on every worker")
        for block_id, (param, state) in parsed.items():  # no await from the checks to the last block: atomic
            block = self.blocks[block_id]
            with torch.no_grad():
                block.own_params().copy_(param)
            block.load_state(state)
            block.snapshot = block.reset_held()
        log.info("shard %d: imported the state of blocks %s", self.index, sorted(states))

    def fetch(self, block_id: str, generation: int = 0) -> tuple[int, Snapshot]:
        self.check_generation(generation, f"fetch of block {block_id}")
        block = self.block(block_id)
        return block.round, block.full_snapshot()
