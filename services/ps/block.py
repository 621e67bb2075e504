"""A block on a shard: its flat parameters, the optimizer over its pieces, the workers' gradient rows.

A block holds flat fp32 parameters, their optimizer and a round counter (the
number of completed aggregations). The optimizer runs over one view per piece
of a model parameter in the block (its segments), so each piece keeps its own
state and a piece that no worker gave a gradient in a round is not stepped.
Gradients of round ``r`` are received into one preallocated row per worker;
when every worker pushed, the rows are summed in worker-id order, divided by
the worker count and handed to ``torch.optim`` with the round's options (see
:mod:`.rounds`). The new parameters are serialized once, already cut into the
chunks that go on the wire, into a snapshot that every pull of that round is
answered with. Where the step is native (dense fp32 blocks, SGD and Adam) it reads one round's parameters and
writes the next round's straight into the buffer of the snapshot it publishes, which holds the block's
parameters from then on: the parameters are double-buffered, never copied per round; a step that writes in
place (torch's) first moves them to memory of their own (:meth:`BlockState.own_params`).

Compression (:mod:`imerge.core.compression`, the block's ``compression``
mode): fp16/bf16 gradients are widened into the fp32 rows and the snapshot
holds the parameters in that dtype; a top-k block keeps each worker's sparse
gradient as it came (no dense row) and adds them in worker order into the
mean, and its snapshot is the sparse update of what every worker holds
(``held``): the parameters that changed, or the largest changes when a pull
ratio bounds it (dense where that is smaller, and after an assignment).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any, Generic, TypeVar

import torch

from imerge.control.messages import RoundScalars
from imerge.core.codec import CHUNK_BYTES, tensor_view
from imerge.core.compression import WIRE_DTYPES, Payload, accumulate, all_finite, encode_pull, parse_mode
from imerge.core.modes import BlockMode
from imerge.core.native import MAX_FUSED_ROWS, AdamStep, DataPlane, SgdStep, adam_step, data_plane
from imerge.core.errors import Internal, InvalidArgument
from imerge.core.optim import OptimizerSpec, apply_hypers, scalar_hypers
from imerge.core.optim_args import eager_step
from imerge.wire.frames import data_frames

from .checkpoint import BlockImage
from .metrics import ShardMetrics
from imerge.core.blockround import BlockRound
from imerge.core.rounds import Push, RoundOptions
from .streams import Row

K = TypeVar("K")
_GRADS_MADE = threading.Lock()  # a block's rows are made once, whichever thread's push comes first


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The parameters of a round as every pull sends them: the payload's bytes (a copy, shared by all pulls,
    that the next round does not touch); gRPC's encoded data frames are made from them on the first gRPC pull."""

    parts: tuple[bytes | memoryview, ...]
    numel: int            # the block's elements
    dtype: str = "float32"
    nnz: int = -1         # sparse: the (index, value) pairs; -1: dense
    nbytes: int = 0

    @property
    def sparse(self) -> bool:
        return self.nnz >= 0

    @functools.cached_property
    def frames(self) -> list[bytes]:
        return [frame for part in self.parts for frame in data_frames(part, CHUNK_BYTES)]


def snapshot_of(param: torch.Tensor, mode: BlockMode = BlockMode(), held: torch.Tensor | None = None) -> Snapshot:
    """The parameters encoded as a block in ``mode`` sends them: fp16/bf16 rounded; for top-k, given what the
    workers hold (``held``, brought up to date), the sparse update (see :func:`sparse_update`)."""
    payload = encode_pull(param, mode, held)
    parts = tuple(bytes(part) for part in payload.parts())
    return Snapshot(parts, param.numel(), payload.dtype, payload.nnz if payload.sparse else -1,
                    sum(len(part) for part in parts))


class Kept(Generic[K]):
    """Things kept for reuse: each given back once the object that holds it (a snapshot, a checkpoint's image)
    is gone, and at most ``kept`` of them waiting (more would only hold memory). Any thread may take one or
    drop the last reference to a holder."""

    def __init__(self, kept: int):
        self.kept = kept
        self._free: list[K] = []
        self._lock = threading.Lock()

    def take(self) -> K | None:
        """One given back earlier, if any waits."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give_back_with(self, holder: object, item: K) -> None:
        """Reuse ``item`` once ``holder`` is gone."""
        weakref.finalize(holder, self._give_back, item)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._free)

    def _give_back(self, item: K) -> None:
        with self._lock:
            if len(self._free) < self.kept:
                self._free.append(item)


class SnapshotBuffers:
    """The buffers a dense block's snapshots are written into, each one reused once no pull holds the snapshot
    that was written into it (nor the block, whose parameters a native step leaves in its snapshot's buffer). A
    fresh buffer per round costs its page faults every round: publishing a 33.5 MB block took 26.5 ms that way
    here, 5 ms into a kept buffer); in the steady state the buffers in use are two (the snapshot of the round
    before, still being sent, and this one's, which holds the parameters)."""

    KEPT = 2  # free buffers kept for reuse (more would only hold memory)

    def __init__(self, dtype: str, numel: int):
        self._dtype_name, self._dtype, self._numel = dtype, WIRE_DTYPES[dtype], numel
        self._nbytes = numel * self._dtype.itemsize
        self._kept: Kept[bytearray] = Kept(self.KEPT)  # the step threads publish, any thread drops a snapshot
        self.allocated = 0  # buffers made so far (a test's view of the reuse)

    def snapshot(self, param: torch.Tensor) -> Snapshot:
        """The parameters (cast to the buffers' dtype, rounded as ``Tensor.to`` rounds) in a buffer of their
        own, until the snapshot is dropped."""
        return self.written(lambda target: target.copy_(param))  # a param of another size raises here

    def written(self, write: Callable[[torch.Tensor], object]) -> Snapshot:
        """A snapshot of what ``write`` puts into the tensor it is given (the buffer, as the buffers' dtype)."""
        buffer = self._kept.take()
        if buffer is None:
            buffer = bytearray(self._nbytes)
            self.allocated += 1
        write(torch.frombuffer(buffer, dtype=self._dtype))
        snapshot = Snapshot((memoryview(buffer),), self._numel, self._dtype_name, -1, self._nbytes)
        self._kept.give_back_with(snapshot, buffer)
        return snapshot

    @property
    def dtype(self) -> str:
        return self._dtype_name

    @property
    def waiting(self) -> int:
        """Free buffers kept for the next snapshots."""
        return self._kept.waiting


class StateCopies:
    """Copies of a block's optimizer state for its checkpoints' images, in tensors kept from one checkpoint to
    the next (fresh copies paid their page faults at every checkpoint: the images of 4 AdamW blocks of 32 MiB
    took 181 ms of CPU here, 26 with kept tensors, see ``scripts/bench_checkpoint.py``); a set is reused once
    no image holds it (checkpoints are written one after the other: one set waits)."""

    def __init__(self) -> None:
        self._kept: Kept[dict[str, torch.Tensor]] = Kept(1)  # taken on the event loop, dropped by the writer

    def copied(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state``'s tensors copied (into kept tensors of the same shape and dtype where there are some)."""
        kept = self._kept.take() or {}
        copies = {}
        for name, value in state.items():
            target = kept.get(name)
            if target is not None and target.shape == value.shape and target.dtype == value.dtype:
                copies[name] = target.copy_(value)
            else:
                copies[name] = value.detach().clone()
        return copies

    def give_back_with(self, holder: object, copies: dict[str, torch.Tensor]) -> None:
        """Reuse ``copies`` once ``holder`` (the image) is gone."""
        self._kept.give_back_with(holder, copies)


@dataclasses.dataclass(frozen=True)
class BlockMeta:
    block_id: str
    dtype: str
    numel: int
    num_workers: int
    optimizer: OptimizerSpec
    segments: tuple[int, ...] = ()  # sizes of the pieces of model parameters the block holds (empty: one piece)
    compression: str = ""           # how its data travel, as the wire names it (see imerge.core.compression)

    @functools.cached_property
    def mode(self) -> BlockMode:
        """The compression mode, parsed once (InvalidArgument where the wire's name is not a mode)."""
        return parse_mode(self.compression)

    @property
    def pieces(self) -> tuple[int, ...]:
        return self.segments or (self.numel,)

    def bounds(self) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(self.pieces))
        return list(zip([0] + ends[:-1], ends))


class BlockState:
    """A block's data (parameters, optimizer, rows, snapshot) and its round (:class:`BlockRound`, whose actions the
    shard carries out on this data)."""

    def __init__(self, meta: BlockMeta, init: torch.Tensor, init_digest: str, plane: DataPlane | None = None,
                 round_: int = 0, trace: list[dict[str, Any]] | None = None):
        self.meta = meta
        self.rounds = BlockRound(meta.block_id, meta.num_workers, round_, trace)  # what a round is: its rules
        self.plane = plane or data_plane()  # sums the rows into the mean (native where built)
        self.init_digest = init_digest
        self.flat = init  # the parameters; each piece below is a view of it, with its own optimizer state
        self.pieces = [torch.nn.Parameter(init[start:end]) for start, end in meta.bounds()]
        self._flat_owner: Snapshot | None = None  # the published snapshot whose buffer holds the parameters
        self.optimizer = meta.optimizer.build(self.pieces)
        self.state_layout = meta.optimizer.state_layout()  # what an import's optimizer state must hold
        self.hypers = scalar_hypers(self.optimizer.param_groups[0], list(self.optimizer.defaults))
        self.sparse = meta.mode.sparse
        self.held = init.clone() if self.sparse else None  # top-k: what every worker holds of the parameters
        # one dense fp32 row per worker, made on the first dense push, with the bytes of each row
        self._grad_rows: tuple[torch.Tensor, list[memoryview]] | None = None
        self._mean: torch.Tensor | None = None   # the round's average of the rows (the steps' gradient)
        self.sparse_grads: list[Payload | None] = [None] * meta.num_workers  # top-k: each worker's, as it came
        self.rows = [Row() for _ in range(meta.num_workers)]  # each worker's pushes, serialized
        self._buffers = None if self.sparse else SnapshotBuffers(meta.mode.cast, meta.numel)  # dense snapshots
        self.snapshot = snapshot_of(self.flat, meta.mode) if self.sparse else self.publish()  # top-k: the whole
        self._state_copies = StateCopies()  # the optimizer state's copies for the checkpoints
        self.waiters: set[Callable[[], None]] = set()  # pulls waiting for the round (called on the event loop)

    @property
    def round(self) -> int:
        """The block's completed rounds: the round its next pushes are of."""
        return self.rounds.round

    def wake(self) -> None:
        """The round completed or failed, or a restore replaced the block: the waiting pulls look again."""
        for waiter in list(self.waiters):
            waiter()

    def publish(self) -> Snapshot:
        """The snapshot of the parameters as they are now (a top-k block's: the update of what the workers
        hold, brought up to date)."""
        if self._buffers is not None:
            return self._buffers.snapshot(self.flat)
        return snapshot_of(self.flat, self.meta.mode, self.held)

    def held_params(self) -> torch.Tensor:
        """What every worker holds of the parameters (a top-k block's)."""
        if self.held is None:
            raise Internal(f"block {self.meta.block_id} is dense: the workers hold its every snapshot")
        return self.held

    @property
    def grads(self) -> torch.Tensor:
        """One dense fp32 row per worker, made by the first dense push (which may come on any thread)."""
        return self._rows()[0]

    def row_view(self, worker: int) -> memoryview:
        """The bytes of ``worker``'s row of :attr:`grads`, which a push's payload is received into."""
        return self._rows()[1][worker]

    def _rows(self) -> tuple[torch.Tensor, list[memoryview]]:
        if self._grad_rows is None:
            with _GRADS_MADE:
                if self._grad_rows is None:
                    grads = torch.zeros(self.meta.num_workers, self.meta.numel)
                    self._grad_rows = (grads, [tensor_view(row) for row in grads])
        return self._grad_rows

    def full_snapshot(self) -> Snapshot:
        """What a fetch sends: every element of what the workers hold (a top-k block's pull snapshot is an update
        of it)."""
        return snapshot_of(self.held_params()) if self.sparse else self.snapshot

    def reset_held(self) -> Snapshot:
        """After an assignment or an import: the workers will hold the parameters as they are (every element)."""
        if self.sparse:
            self.held_params().copy_(self.flat)
            return snapshot_of(self.flat, self.meta.mode)
        return self.publish()

    @classmethod
    def from_image(cls, image: BlockImage, round_: int, plane: DataPlane | None = None,
                   trace: list[dict[str, Any]] | None = None) -> "BlockState":
        meta = BlockMeta(image.block_id, "float32", image.param.numel(), image.num_workers, image.optimizer,
                         image.segments, image.compression)
        block = cls(meta, image.param.clone(), image.init_digest, plane, round_, trace)
        block.load_state(image.state)
        return block

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the optimizer state with ``state`` ("<piece>/<name>" -> tensor)."""
        by_piece: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            piece, _, name = key.partition("/")
            by_piece.setdefault(int(piece), {})[name] = value.clone()
        self.optimizer.state.clear()
        self.optimizer.load_state_dict({"state": by_piece, "param_groups": self.optimizer.state_dict()["param_groups"]})

    def image(self) -> BlockImage:
        """The parameters and a copy of the optimizer state (``"<piece>/<name>"``), for a checkpoint. A dense
        float32 block's parameters are its published snapshot's (no copy: nothing writes a snapshot once it is
        published, and its buffer is not reused while the image holds it); other blocks' are copied. The state's
        copies are reused by a later image once this one is dropped (:class:`StateCopies`)."""
        state = self._state_copies.copied({
            f"{index}/{name}": value for index, piece in enumerate(self.pieces)
            for name, value in self.optimizer.state.get(piece, {}).items() if isinstance(value, torch.Tensor)})
        snapshot = self.snapshot
        if self._buffers is not None and snapshot.dtype == "float32" and not snapshot.sparse:
            param, owner = torch.frombuffer(snapshot.parts[0], dtype=torch.float32), snapshot
        else:
            param, owner = self.flat.detach().clone(), None
        image = BlockImage(self.meta.block_id, self.meta.num_workers, self.meta.optimizer, self.init_digest,
                           param, state, self.meta.segments, self.meta.compression, owner)
        self._state_copies.give_back_with(image, state)
        return image

    def average(self, metrics: ShardMetrics, options: RoundOptions) -> tuple[torch.Tensor | None, RoundScalars]:
        """The pushed gradients averaged in worker-id order (and unscaled), with what the round's agreement needs
        of them (runs off the event loop)."""
        if options.assign:
            return None, RoundScalars()
        with metrics.aggregation.time(), torch.no_grad():
            if self.sparse:  # the workers' sparse gradients added in worker order; zeros elsewhere
                mean = torch.zeros(self.meta.numel)
                for worker, payload in enumerate(self.sparse_grads):
                    if payload is None:
                        raise Internal(f"block {self.meta.block_id}: worker {worker}'s gradient is missing")
                    accumulate(mean, payload)
                mean.div_(self.meta.num_workers)
                finite = None
            else:  # in one pass, into a buffer kept from round to round (a fresh one costs its page faults)
                if self._mean is None:
                    self._mean = torch.empty(self.meta.numel)
                mean = self._mean
                finite = self.plane.mean_rows(mean, list(self.grads), self.meta.num_workers)
            if options.loss_scale:  # as GradScaler.unscale_: times the float32 reciprocal of the scale
                mean.mul_(torch.tensor(options.loss_scale, dtype=torch.float64).reciprocal().float())
                finite = None
            if options.needs_agreement and finite is None:  # before the clamp: an inf clamped is still an overflow
                finite = all_finite(mean)
            if options.clip_value:  # as torch.nn.utils.clip_grad_value_, before clipping by the norm
                mean.clamp_(-options.clip_value, options.clip_value)
            if not options.needs_agreement:
                return mean, RoundScalars()
            return mean, RoundScalars(self.plane.sum_of_squares(mean) if finite else 0.0, not finite)

    def aggregate(self, metrics: ShardMetrics, options: RoundOptions, no_grad: Collection[int]) -> Snapshot:
        """:meth:`average`, then :meth:`step`: a round that needs no agreement of the shards (runs off the event
        loop); SGD and Adam in native passes where the data plane gives torch's bits for them."""
        fused = self._fused_step(metrics, options, no_grad)
        if fused is not None:
            return fused
        mean, scalars = self.average(metrics, options)
        return self.step(metrics, mean, options, no_grad, scalars)

    def _fused_step(self, metrics: ShardMetrics, options: RoundOptions, no_grad: Collection[int]) -> Snapshot | None:
        """The round's mean, optimizer step and float32 snapshot in native passes over each piece (SGD: one;
        Adam: two, and torch's square root); None where that does not apply: options that change the mean (they
        step by :meth:`step`, natively where :meth:`_native_step` can), or more workers than a fused pass takes."""
        if self._grad_rows is None or options.assign or options.loss_scale or options.max_norm or \
                options.clip_value or self.meta.num_workers > MAX_FUSED_ROWS:
            return None
        with metrics.aggregation.time():  # the round's one pass: the sum, the step and the snapshot
            return self._native_step(list(self.grads), self.meta.num_workers, no_grad, options.hypers)

    def _native_step(self, rows: list[torch.Tensor], divisor: int, no_grad: Collection[int], hypers: str
                     ) -> Snapshot | None:
        """The optimizer's step on the mean of ``rows`` (the workers' gradients, or one row already averaged,
        unscaled and clipped, with divisor 1: the same bits as torch's step on it), the new parameters written
        into the float32 snapshot that holds them from then on (:meth:`_hold_params`), in native passes per
        piece; None where that does not apply: compressed or sparse blocks, pieces without gradient, an optimizer
        other than single-tensor SGD, Adam or AdamW, state that torch's first step has not made yet, or a machine
        whose probe of the variant found other bits than torch's."""
        buffers = self._buffers
        if buffers is None or buffers.dtype != "float32" or no_grad:
            return None
        apply_hypers(self.optimizer, self.hypers, hypers)
        step = SgdStep.of(self.optimizer) or AdamStep.of(self.optimizer)
        if step is None or not self.plane.fused_step(step):
            return None
        states = [self.optimizer.state.get(piece, {}) for piece in self.pieces]
        needed = ("exp_avg", "exp_avg_sq", "step") if isinstance(step, AdamStep) else \
            ("momentum_buffer",) if step.momentum else ()
        if any(state.get(name) is None for state in states for name in needed):
            return None

        def write(target: torch.Tensor) -> None:  # the new parameters into the snapshot's buffer: no copy
            with torch.no_grad():
                for piece, state, (start, end) in zip(self.pieces, states, self.meta.bounds()):
                    piece_rows = [row[start:end] for row in rows]
                    if isinstance(step, AdamStep):
                        adam_step(self.plane, piece, piece_rows, divisor, step, state, target[start:end])
                    else:
                        self.plane.sgd_step(piece, piece_rows, divisor, step, state.get("momentum_buffer"),
                                            target[start:end])

        snapshot = buffers.written(write)
        self._hold_params(torch.frombuffer(snapshot.parts[0], dtype=torch.float32), snapshot)
        return snapshot

    def _hold_params(self, flat: torch.Tensor, owner: Snapshot | None) -> None:
        """The parameters are ``flat`` from now on (each piece a view of it; the optimizer's state stays with the
        piece), kept in the buffer of the snapshot ``owner`` (None: their own), which nothing writes again."""
        self.flat, self._flat_owner = flat, owner
        for piece, (start, end) in zip(self.pieces, self.meta.bounds()):
            piece.data = flat[start:end]

    def own_params(self) -> torch.Tensor:
        """The parameters in memory of their own, for a step that writes them in place (a published snapshot's
        buffer holds them after a native step, which writes the next round's parameters into another buffer);
        returns them."""
        if self._flat_owner is not None:
            self._hold_params(self.flat.clone(), None)
        return self.flat

    def step(self, metrics: ShardMetrics, mean: torch.Tensor | None, options: RoundOptions, no_grad: Collection[int],
             total: RoundScalars) -> Snapshot:
        """Step with the round's hyperparameters; a piece that no worker gave a gradient is skipped, as
        torch.optim skips a parameter whose grad is None. An assignment takes worker 0's data as the
        parameters; a round in which some shard found an inf or NaN is skipped on every block; clipping scales
        the gradient as torch.nn.utils.clip_grad_norm_ does (runs off the event loop)."""
        with torch.no_grad():
            if options.assign:  # every element: the workers' copies may differ from the parameters anywhere
                self.own_params().copy_(self.grads[0])
                return self.reset_held()
            if total.found_inf:
                return self.publish() if self.sparse else self.snapshot
            if mean is None:
                raise Internal(f"block {self.meta.block_id}: a gradient round without its mean")
            if options.max_norm:
                mean.mul_((options.max_norm / (torch.tensor(total.grad_norm, dtype=torch.float32) + 1e-6))
                          .clamp(max=1.0))
        with metrics.optimizer_step.time():  # one observation per round, whichever step takes it
            # the mean unscaled and clipped: one row, stepped natively where it can (the snapshot written with it)
            native = self._native_step([mean], 1, no_grad, options.hypers) \
                if mean.dtype == torch.float32 and mean.is_contiguous() else None
            if native is None:
                self.own_params()  # torch steps in place
                self._torch_step(mean, no_grad, options.hypers)
        return native if native is not None else self.publish()

    def _torch_step(self, mean: torch.Tensor, no_grad: Collection[int], hypers: str) -> None:
        """``torch.optim``'s step on ``mean`` with the round's hyperparameters, the pieces without gradient
        skipped."""
        for index, (piece, (start, end)) in enumerate(zip(self.pieces, self.meta.bounds())):
            piece.grad = None if index in no_grad else mean[start:end]
        apply_hypers(self.optimizer, self.hypers, hypers)
        eager_step(self.optimizer)  # no hooks, never compiled: without torch.compile's wrapper
        for piece in self.pieces:
            piece.grad = None

    def check_push(self, push: Push) -> None:
        """Refuse a push whose pieces without gradient do not exist, or whose hyperparameters the block's optimizer
        cannot take (before its round's rules: :meth:`BlockRound.offer`)."""
        bad = [index for index in push.no_grad if not 0 <= index < len(self.pieces)]
        if bad:
            raise InvalidArgument(f"{push.what}: pieces without gradient {bad} outside 0..{len(self.pieces) - 1}")
        counted = self.rounds.options
        if counted is None or push.options.hypers != counted.hypers:  # else: checked already
            self.meta.optimizer.check_hypers(self.hypers, push.options.hypers, push.what)
