"""A block's whole state as one safetensors file: what a shard exports and imports (imerge.save / load).

``param`` holds the block's flat fp32 parameters; ``state/<piece>/<name>`` the
optimizer state of each piece of a model parameter the block holds (a 1-D
tensor per element, or a 0-dim scalar such as Adam's ``step``). Nothing is
pickled, so a file from anywhere can be parsed safely; whatever does not fit
the block is an :class:`InvalidArgument` naming it.
"""
from __future__ import annotations

import torch
from safetensors.torch import load, save

from imerge.core.errors import InvalidArgument


def block_state_bytes(param: torch.Tensor, state: dict[str, torch.Tensor]) -> bytes:
    return save({"param": param.contiguous(), **{f"state/{key}": value.contiguous() for key, value in state.items()}})


def parse_block_state(data: bytes, numel: int, pieces: tuple[int, ...],
                      what: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(parameters, optimizer state "<piece>/<name>") of ``block_state_bytes``, checked against the block."""
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - any malformed file is the caller's error
        raise InvalidArgument(f"{what}: not a safetensors block state: {exc}") from None
    param = tensors.pop("param", None)
    if param is None or param.dtype != torch.float32 or param.numel() != numel:
        raise InvalidArgument(f"{what}: expected 'param' of {numel} float32 elements")
    state = {}
    for key, value in tensors.items():
        piece, _, name = key.removeprefix("state/").partition("/")
        if not key.startswith("state/") or not piece.isdigit() or int(piece) >= len(pieces) or not name:
            raise InvalidArgument(f"{what}: unexpected tensor {key!r} (expected state/<piece>/<name>)")
        if value.dim() > 1 or (value.dim() == 1 and value.numel() != pieces[int(piece)]):
            raise InvalidArgument(f"{what}: {key} has shape {list(value.shape)}; piece {piece} has "
                                  f"{pieces[int(piece)]} elements")
        state[key.removeprefix("state/")] = value
    return param.reshape(-1), state
