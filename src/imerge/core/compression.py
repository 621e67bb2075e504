"""Compression of the data on the wire: one interface, Horovod style, and the payloads it makes.

A compressor turns a block's flat fp32 tensor into a :class:`Payload` and a
context (``compress(tensor) -> (payload, ctx)``); the shard adds payloads into
the round's mean as they are (:func:`accumulate`) and a dense tensor is made of
a sparse one with :func:`densify`:

* ``none``: the fp32 tensor itself (dense).
* ``fp16`` / ``bf16``: the tensor rounded to that type (dense, half the bytes).
* ``topk``: the ``ratio`` largest elements by magnitude, as (indices, fp32
  values), with error feedback: what a worker did not send is its residual,
  added to its next gradient of that block before the selection.

A block's *mode* (``"fp16"``, ``"bf16"``, ``"topk:0.01"``, ``""`` for none)
is fixed when the block is created (``BlockSpec.compression``): the shard
refuses a push whose encoding disagrees with it. ``mixed`` chooses per group:
groups under a byte threshold fp16, larger ones top-k.

On the wire a dense payload is its values' bytes; a sparse one is ``nnz``
little-endian int32 indices (strictly increasing) followed by ``nnz`` values.
Pure: no grpc, no redis.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch

from imerge.core.codec import tensor_view
from imerge.core.errors import InvalidArgument
from imerge.core.modes import CAST_MODES, INDEX_BYTES, WIRE_ITEMSIZE, BlockMode, topk_count

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
assert {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()} == WIRE_ITEMSIZE


@dataclasses.dataclass(frozen=True)
class Payload:
    """What travels of one block: dense values, or (indices, values) of a sparse tensor."""

    values: torch.Tensor                  # contiguous CPU float32 / float16 / bfloat16
    indices: torch.Tensor | None = None   # int32, strictly increasing (sparse)
    length: int = -1                      # sparse: the dense tensor's element count

    @property
    def numel(self) -> int:
        """The elements of the tensor it stands for (a sparse payload's dense size)."""
        return self.length if self.sparse else self.values.numel()

    @property
    def dtype(self) -> str:
        return str(self.values.dtype).removeprefix("torch.")

    @property
    def sparse(self) -> bool:
        return self.indices is not None

    @property
    def index(self) -> torch.Tensor:
        """A sparse payload's indices."""
        if self.indices is None:
            raise ValueError("a dense payload has no indices")
        return self.indices

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What goes on the wire, in order: [indices,] values."""
        return [self.values] if self.indices is None else [self.indices, self.values]

    @property
    def nnz(self) -> int:
        return self.values.numel() if self.sparse else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def parts(self) -> list[memoryview]:
        """The payload's bytes as they go on the wire, without a copy: [indices,] values."""
        return [tensor_view(t.contiguous().view(torch.uint8)) for t in self.tensors]


class Compressor(Protocol):
    @property
    def mode(self) -> BlockMode: ...

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, int]: ...


class NoneCompressor:
    mode = BlockMode()

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, int]:
        return Payload(tensor), tensor.numel()


class CastCompressor:
    """The tensor rounded to fp16 or bf16 (round to nearest even, as ``Tensor.to``)."""

    def __init__(self, mode: BlockMode):
        self.mode = mode
        self.dtype = WIRE_DTYPES[mode.cast]

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, int]:
        return Payload(tensor.to(self.dtype)), tensor.numel()


def select_topk(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64, increasing) of the ``k`` elements of largest magnitude."""
    return torch.topk(tensor.abs(), k, sorted=False).indices.sort().values


class TopKCompressor:
    """Top-k by magnitude with error feedback: one instance per block (it holds the block's residual)."""

    def __init__(self, mode: BlockMode, numel: int):
        self.mode = mode
        self.k = topk_count(mode.ratio, numel)
        self.residual = torch.zeros(numel)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, int]:
        corrected = self.residual.add_(tensor)  # in place: the residual becomes what is left after sending
        indices = select_topk(corrected, self.k)
        values = corrected[indices]
        given = values != 0
        if not bool(given.all()):  # zeros are not sent: a piece nobody gave a gradient stays without one
            indices, values = indices[given], values[given]
        corrected[indices] = 0.0
        return Payload(values, indices.to(torch.int32), tensor.numel()), tensor.numel()


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element is finite. A finite sum (in fp32, so fp16 values cannot overflow it) proves it in
    one pass without allocating (a NaN or an infinity makes the sum NaN or infinite); only a sum that is not
    finite is checked element by element."""
    return math.isfinite(float(values.sum(dtype=torch.float32))) or bool(torch.isfinite(values).all())


def accumulate(total: torch.Tensor, payload: Payload) -> torch.Tensor:
    """``total`` (fp32) plus the tensor ``payload`` stands for, in place: a sparse payload is added at its
    indices (nothing dense is made of it), a dense one widened."""
    if payload.sparse:
        return total.index_add_(0, payload.index.long(), payload.values.float())
    return total.add_(payload.values)


def densify(payload: Payload, numel: int) -> torch.Tensor:
    dense = torch.zeros(numel)
    dense[payload.index.long()] = payload.values.float()
    return dense


def make_compressor(mode: BlockMode, numel: int) -> Compressor:
    """The compressor of a block whose mode is ``mode``."""
    if mode.sparse:
        return TopKCompressor(mode, numel)
    return CastCompressor(mode) if mode.kind in CAST_MODES else NoneCompressor()


def _ratio(text: str, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if (0 <= value <= 1 if zero_ok else 0 < value <= 1) else math.nan


def parse_mode(mode: str) -> BlockMode:
    """A block's mode as the wire names it (``str(mode)``): "" (none), "fp16", "bf16", "topk:<ratio>" or
    "topk:<ratio>:<pull ratio>"; parsed once, where a block's spec arrives."""
    kind, *ratios = mode.split(":")
    if mode in ("", "none"):
        return BlockMode()
    if kind in CAST_MODES and not ratios:
        return BlockMode(kind)
    if kind == "topk" and len(ratios) in (1, 2):
        ratio, pull = _ratio(ratios[0], False), _ratio(ratios[1], True) if len(ratios) == 2 else 0.0
        if not (math.isnan(ratio) or math.isnan(pull)):
            return BlockMode("topk", ratio, pull)
    raise InvalidArgument(f"compression {mode!r} is not one of '', fp16, bf16, topk:<ratio in (0, 1]>"
                          f"[:<pull ratio in [0, 1]>]")


def expected_encoding(mode: BlockMode) -> tuple[str, bool]:
    """(dtype, sparse) of a gradient payload of a block in ``mode``."""
    return mode.cast, mode.sparse


def sparse_update(param: torch.Tensor, held: torch.Tensor, pull_ratio: float) -> Payload:
    """What a pull of a top-k block sends, given what the workers hold (``held``, brought up to date in place):
    every parameter that changed, or with ``pull_ratio`` at most that fraction of the block, the largest changes
    (the rest stay owed, like a push's residual). Sparse (index + fp32 value) where smaller than dense."""
    changed = (param != held).nonzero().reshape(-1)
    limit = topk_count(pull_ratio, param.numel()) if pull_ratio else param.numel()
    if changed.numel() > limit:
        changed = select_topk(param - held, limit)
    held[changed] = param[changed]
    if changed.numel() * (INDEX_BYTES + 4) < param.numel() * 4:
        return Payload(held[changed], changed.to(torch.int32), param.numel())
    return Payload(held)


def encode_pull(param: torch.Tensor, mode: BlockMode, held: torch.Tensor | None = None) -> Payload:
    """The parameters as a pull of a block in ``mode`` sends them: fp32 as they are, fp16/bf16 rounded; for
    top-k, given what the workers hold (``held``, brought up to date in place), the sparse update (see
    :func:`sparse_update`)."""
    if held is not None:
        return sparse_update(param, held, mode.pull_ratio)
    return Payload(param.to(WIRE_DTYPES[mode.cast]) if mode.cast != "float32" else param)


def check_sparse(indices: torch.Tensor, numel: int, what: str) -> None:
    """Refuse indices outside 0..numel-1 or not strictly increasing (a repeated index would count twice)."""
    if indices.numel() == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise InvalidArgument(f"{what}: sparse indices outside 0..{numel - 1} "
                              f"(from {int(indices[0])} to {int(indices[-1])})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise InvalidArgument(f"{what}: sparse indices are not strictly increasing")
