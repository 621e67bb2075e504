"""A block's whole state as one safetensors file: what a shard exports and imports (imerge.save / load).

``param`` holds the block's flat fp32 parameters; ``state/<piece>/<name>`` the
optimizer state of each piece of a model parameter the block holds (a 1-D
tensor per element, or a 0-dim scalar such as Adam's ``step``). Nothing is
pickled, so a file from anywhere can be parsed safely; whatever does not fit
the block is an :class:`InvalidArgument` naming it: the size (bounded by
:func:`state_bytes_bound` before a byte is kept), a header with metadata, a
parameter that is not a flat fp32 tensor of the block's size, a state tensor
the block's optimizer does not keep (its ``layout``: name, dimensions, dtype),
or a piece with only part of its state.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from safetensors.torch import load, save

from imerge.core.errors import InvalidArgument

Layout = Sequence[tuple[str, int, str]]  # each optimizer state tensor of a piece: (name, dimensions, dtype)
HEADER_BYTES_PER_TENSOR = 192  # a safetensors header entry: name, dtype, shape, offsets (with room)


def block_state_bytes(param: torch.Tensor, state: dict[str, torch.Tensor]) -> bytes:
    return save({"param": param.contiguous(), **{f"state/{key}": value.contiguous() for key, value in state.items()}})


def state_bytes_bound(numel: int, pieces: int, layout: Layout) -> int:
    """The most bytes a block's state may take: its parameters, each piece's state, the header."""
    per_element = sum(1 for _, dims, _ in layout if dims == 1)
    scalars = sum(1 for _, dims, _ in layout if dims == 0)
    tensors = 1 + pieces * len(layout)
    return 8 + 1024 + tensors * HEADER_BYTES_PER_TENSOR + 4 * numel * (1 + per_element) + 8 * pieces * scalars


def _check_header(data: bytes, what: str) -> None:
    if len(data) < 8:
        raise InvalidArgument(f"{what}: {len(data)} bytes is not a safetensors block state")
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size]) if size <= len(data) - 8 else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{what}: not a safetensors block state (its header is not a JSON object)")
    if "__metadata__" in header:
        raise InvalidArgument(f"{what}: a block state carries no __metadata__")


def parse_block_state(data: bytes, numel: int, pieces: tuple[int, ...], what: str,
                      layout: Layout | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(parameters, optimizer state "<piece>/<name>") of ``block_state_bytes``, checked against the block (and,
    given the optimizer's ``layout``, against the state it keeps)."""
    _check_header(data, what)
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - any malformed file is the caller's error
        raise InvalidArgument(f"{what}: not a safetensors block state: {exc}") from None
    param = tensors.pop("param", None)
    if param is None or param.dtype != torch.float32 or param.dim() != 1 or param.numel() != numel:
        raise InvalidArgument(f"{what}: expected 'param', a flat tensor of {numel} float32 elements")
    state = {}
    kinds = {name: (dims, dtype) for name, dims, dtype in layout or ()}
    for key, value in tensors.items():
        piece, _, name = key.removeprefix("state/").partition("/")
        if not key.startswith("state/") or not piece.isdigit() or int(piece) >= len(pieces) or not name:
            raise InvalidArgument(f"{what}: unexpected tensor {key!r} (expected state/<piece>/<name>)")
        if value.dim() > 1 or (value.dim() == 1 and value.numel() != pieces[int(piece)]):
            raise InvalidArgument(f"{what}: {key} has shape {list(value.shape)}; piece {piece} has "
                                  f"{pieces[int(piece)]} elements")
        if layout is not None and kinds.get(name) != (value.dim(), str(value.dtype).removeprefix("torch.")):
            raise InvalidArgument(f"{what}: {key} ({value.dim()}-D {value.dtype}) is not state the block's "
                                  f"optimizer keeps: {sorted(kinds.items())}")
        state[key.removeprefix("state/")] = value
    if layout is not None:
        _check_complete(state, kinds, what)
    return param, state


def _check_complete(state: dict[str, torch.Tensor], kinds: dict[str, tuple[int, str]], what: str) -> None:
    """Each piece has all of its optimizer's state or none (a step needs all of it)."""
    names: dict[str, set[str]] = {}
    for key in state:
        piece, _, name = key.partition("/")
        names.setdefault(piece, set()).add(name)
    for piece, present in names.items():
        if present != set(kinds):
            raise InvalidArgument(f"{what}: piece {piece} has state {sorted(present)}, not all of "
                                  f"{sorted(kinds)} (or none)")
