from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[Encoding]
    SPARSE: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
DENSE: Encoding
SPARSE: Encoding

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "options_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    options_json: str
    def __init__(self, name: _Optional[str] = ..., options_json: _Optional[str] = ...) -> None: ...

class BlockSpec(_message.Message):
    __slots__ = ("block_id", "dtype", "numel", "num_workers", "optimizer", "segments", "compression")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    dtype: DType
    numel: int
    num_workers: int
    optimizer: OptimizerSpec
    segments: _containers.RepeatedScalarFieldContainer[int]
    compression: str
    def __init__(self, block_id: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., num_workers: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., segments: _Optional[_Iterable[int]] = ..., compression: _Optional[str] = ...) -> None: ...

class InitBlockChunk(_message.Message):
    __slots__ = ("spec", "data")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    spec: BlockSpec
    data: bytes
    def __init__(self, spec: _Optional[_Union[BlockSpec, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitBlockReply(_message.Message):
    __slots__ = ("block_id", "created", "round")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    created: bool
    round: int
    def __init__(self, block_id: _Optional[str] = ..., created: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("block_id", "worker", "round", "dtype", "numel", "generation", "fence", "lane", "hypers", "no_grad", "assign", "loss_scale", "max_norm", "encoding", "nnz", "clip_value")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    HYPERS_FIELD_NUMBER: _ClassVar[int]
    NO_GRAD_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    CLIP_VALUE_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    worker: int
    round: int
    dtype: DType
    numel: int
    generation: int
    fence: int
    lane: int
    hypers: str
    no_grad: _containers.RepeatedScalarFieldContainer[int]
    assign: bool
    loss_scale: float
    max_norm: float
    encoding: Encoding
    nnz: int
    clip_value: float
    def __init__(self, block_id: _Optional[str] = ..., worker: _Optional[int] = ..., round: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., generation: _Optional[int] = ..., fence: _Optional[int] = ..., lane: _Optional[int] = ..., hypers: _Optional[str] = ..., no_grad: _Optional[_Iterable[int]] = ..., assign: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., max_norm: _Optional[float] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., nnz: _Optional[int] = ..., clip_value: _Optional[float] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BlockPushResult(_message.Message):
    __slots__ = ("block_id", "duplicate", "pushed")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    duplicate: bool
    pushed: int
    def __init__(self, block_id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., pushed: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BlockPushResult]
    def __init__(self, results: _Optional[_Iterable[_Union[BlockPushResult, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("block_ids", "worker", "round", "timeout_s", "generation")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    worker: int
    round: int
    timeout_s: float
    generation: int
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., worker: _Optional[int] = ..., round: _Optional[int] = ..., timeout_s: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("block_ids", "generation")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("block_id", "dtype", "numel", "round", "skipped", "grad_norm", "encoding", "nnz")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    dtype: DType
    numel: int
    round: int
    skipped: bool
    grad_norm: float
    encoding: Encoding
    nnz: int
    def __init__(self, block_id: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., round: _Optional[int] = ..., skipped: _Optional[bool] = ..., grad_norm: _Optional[float] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., nnz: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("meta", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    data: bytes
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("block_ids", "generation")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ...) -> None: ...

class BlockStateMeta(_message.Message):
    __slots__ = ("block_id", "round", "nbytes", "generation")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    round: int
    nbytes: int
    generation: int
    def __init__(self, block_id: _Optional[str] = ..., round: _Optional[int] = ..., nbytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class BlockStateChunk(_message.Message):
    __slots__ = ("meta", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: BlockStateMeta
    data: bytes
    def __init__(self, meta: _Optional[_Union[BlockStateMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportReply(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockStats(_message.Message):
    __slots__ = ("block_id", "numel", "round", "pushed", "num_workers")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    numel: int
    round: int
    pushed: int
    num_workers: int
    def __init__(self, block_id: _Optional[str] = ..., numel: _Optional[int] = ..., round: _Optional[int] = ..., pushed: _Optional[int] = ..., num_workers: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard_index", "blocks", "bytes_received", "bytes_sent", "pushes", "duplicate_pushes", "pulls", "rounds_completed", "rejected")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockStats]
    bytes_received: int
    bytes_sent: int
    pushes: int
    duplicate_pushes: int
    pulls: int
    rounds_completed: int
    rejected: int
    def __init__(self, shard_index: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockStats, _Mapping]]] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., pushes: _Optional[int] = ..., duplicate_pushes: _Optional[int] = ..., pulls: _Optional[int] = ..., rounds_completed: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class ChannelRequest(_message.Message):
    __slots__ = ("worker", "generation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    generation: int
    def __init__(self, worker: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ChannelReply(_message.Message):
    __slots__ = ("port", "token", "idle_s", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    idle_s: float
    tls: bool
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., idle_s: _Optional[float] = ..., tls: _Optional[bool] = ...) -> None: ...

class ChannelHello(_message.Message):
    __slots__ = ("token", "worker", "generation")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    worker: int
    generation: int
    def __init__(self, token: _Optional[bytes] = ..., worker: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ChannelError(_message.Message):
    __slots__ = ("error", "message")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error: str
    message: str
    def __init__(self, error: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
