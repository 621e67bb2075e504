"""The lean data path's frames are exactly protobuf's encoding of the data-carrying messages."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError

from imerge.core.codec import tensor_view
from imerge.core.compression import all_finite
from imerge.wire.frames import (DataFrame, carries_data, data_frame, data_frames, deserializer,
                                frame_payload_bytes, serialize)
from imerge.wire.rpc import ps_pb2


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, (1 << 20) + 3])
@pytest.mark.parametrize("message", [ps_pb2.PushChunk, ps_pb2.TensorChunk, ps_pb2.InitBlockChunk])
def test_a_frame_is_the_protobuf_encoding_and_parses_as_a_view(size, message):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    frame = data_frame(payload)
    assert frame == message(data=payload).SerializeToString()
    assert frame_payload_bytes(frame) == size and serialize(frame) is frame
    parsed = deserializer(message)(frame)
    if size:
        assert isinstance(parsed, DataFrame) and parsed.WhichOneof("part") == "data"
        assert bytes(parsed.data) == payload and parsed.data.obj is frame  # a view: no copy
    else:  # a set oneof field is written even when empty: tag and length 0
        assert bytes(parsed.data) == b""


def test_other_messages_and_garbage_go_to_protobuf():
    header = ps_pb2.PushChunk(header=ps_pb2.PushHeader(block_id="b0", worker=1, round=2, numel=3))
    parsed = deserializer(ps_pb2.PushChunk)(serialize(header))
    assert parsed.WhichOneof("part") == "header" and parsed.header.block_id == "b0"
    frame = data_frame(b"abcd")
    two = frame + frame  # two data fields: protobuf keeps the last, as a message
    assert deserializer(ps_pb2.PushChunk)(two).data == b"abcd"
    for garbage in (b"\x12", b"\x12\x05ab", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x12\x80"):
        with pytest.raises(DecodeError):
            deserializer(ps_pb2.PushChunk)(garbage)
    assert not carries_data(ps_pb2.PullRequest) and deserializer(ps_pb2.PullRequest) == ps_pb2.PullRequest.FromString


def test_frames_cut_a_tensor_into_chunks_that_join_back():
    values = torch.arange(1000, dtype=torch.float32)
    frames = list(data_frames(tensor_view(values), 1024))
    assert [frame_payload_bytes(f) for f in frames] == [1024, 1024, 1024, 928]
    joined = b"".join(bytes(deserializer(ps_pb2.TensorChunk)(f).data) for f in frames)
    assert torch.equal(torch.frombuffer(bytearray(joined), dtype=torch.float32), values)


def test_the_finite_check_is_exact():
    values = torch.randn(10_000)
    assert all_finite(values) and all_finite(torch.full((1 << 16,), 3.4e38))  # the sum overflows; all finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = values.clone()
        broken[1234] = bad
        assert not all_finite(broken)
    pair = values.clone()
    pair[1], pair[2] = float("inf"), float("-inf")
    assert not all_finite(pair)
