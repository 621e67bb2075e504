"""The proto's element types and payload encodings, by the names the rest of IMerge uses."""
from __future__ import annotations

from imerge.core.errors import InvalidArgument
from imerge.wire.rpc import ps_pb2

DTYPE_ENUM = {"float32": ps_pb2.FLOAT32, "float16": ps_pb2.FLOAT16, "bfloat16": ps_pb2.BFLOAT16}
DTYPE_NAME = {value: name for name, value in DTYPE_ENUM.items()}


def dtype_name(value: int, what: str) -> str:
    try:
        return DTYPE_NAME[value]
    except KeyError:
        raise InvalidArgument(f"{what}: unsupported dtype {value}") from None


def nnz_of(message) -> int:
    """A PushHeader's or TensorMeta's sparse pair count, or -1 for a dense payload."""
    if message.encoding == ps_pb2.DENSE:
        return -1
    if message.encoding == ps_pb2.SPARSE:
        return message.nnz
    raise InvalidArgument(f"unsupported payload encoding {message.encoding}")


def encoding_fields(nnz: int) -> dict:
    """The PushHeader / TensorMeta fields of a payload with ``nnz`` pairs (-1: dense)."""
    return {"encoding": ps_pb2.SPARSE, "nnz": nnz} if nnz >= 0 else {"encoding": ps_pb2.DENSE}
