"""The proto's element types and payload encodings, by the names the rest of IMerge uses."""
from __future__ import annotations

from typing import Any

from imerge.core.errors import InvalidArgument
from imerge.core.limits import clip
from imerge.core.rounds import Push, RoundOptions
from imerge.wire.rpc import ps_pb2

DTYPE_ENUM = {"float32": ps_pb2.FLOAT32, "float16": ps_pb2.FLOAT16, "bfloat16": ps_pb2.BFLOAT16}
DTYPE_NAME: dict[int, str] = {value: name for name, value in DTYPE_ENUM.items()}


def dtype_name(value: int, what: str) -> str:
    try:
        return DTYPE_NAME[value]
    except KeyError:
        raise InvalidArgument(f"{what}: unsupported dtype {value}") from None


def nnz_of(message: Any) -> int:
    """A PushHeader's or TensorMeta's sparse pair count, or -1 for a dense payload."""
    if message.encoding == ps_pb2.DENSE:
        return -1
    if message.encoding == ps_pb2.SPARSE:
        return int(message.nnz)
    raise InvalidArgument(f"unsupported payload encoding {message.encoding}")


def encoding_fields(nnz: int) -> dict[str, Any]:
    """The PushHeader / TensorMeta fields of a payload with ``nnz`` pairs (-1: dense)."""
    return {"encoding": ps_pb2.SPARSE, "nnz": nnz} if nnz >= 0 else {"encoding": ps_pb2.DENSE}


def tensor_meta(block_id: str, round_: int, dtype: str, numel: int, nnz: int, result: tuple[bool, float]
                ) -> ps_pb2.TensorMeta:
    """What precedes a pulled block's data: its encoding, the round it is of and the round's (skipped, norm)."""
    skipped, grad_norm = result
    return ps_pb2.TensorMeta(block_id=block_id, dtype=DTYPE_ENUM[dtype], numel=numel, round=round_,
                             skipped=skipped, grad_norm=grad_norm, **encoding_fields(nnz))


def push_of(header: ps_pb2.PushHeader) -> Push:
    """The push a ``PushHeader`` describes (the gRPC stream's and the data channel's): parsed here, once."""
    what = f"push of block {clip(header.block_id)} by worker {header.worker}"
    return Push(header.block_id, header.worker, header.round, dtype_name(header.dtype, what), header.numel,
                nnz_of(header), header.generation, header.fence, header.lane,
                RoundOptions(header.hypers, header.assign, header.loss_scale, header.max_norm, header.clip_value),
                tuple(header.no_grad))


def push_header(push: Push) -> ps_pb2.PushHeader:
    """The ``PushHeader`` of ``push``: encoded here, once."""
    options = push.options
    return ps_pb2.PushHeader(block_id=push.block_id, worker=push.worker, round=push.round,
                             dtype=DTYPE_ENUM[push.dtype], numel=push.numel, generation=push.generation,
                             fence=push.fence, lane=push.lane, hypers=options.hypers, no_grad=push.no_grad,
                             assign=options.assign, loss_scale=options.loss_scale, max_norm=options.max_norm,
                             clip_value=options.clip_value, **encoding_fields(push.nnz))
