"""Tensor data on the wire without protobuf objects: the lean data path.

The data chunks of ``InitBlockChunk``, ``PushChunk`` and ``TensorChunk`` are
each the message's field 2 (``bytes data`` of its ``part`` oneof). Their wire
form is one tag byte, the payload's length as a varint, and the payload: a
sender writes that frame straight from the tensor's memory (one copy), and a
receiver reads the payload as a view of the received bytes (no copy). The
frames are exactly the protobuf encoding of those messages, so the contract in
``proto/`` is unchanged and any protobuf peer interoperates. Headers and
metadata still travel as protobuf messages; anything that is not a
well-formed data frame is parsed by protobuf (which raises ``DecodeError``
on garbage).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

_DATA_TAG = 0x12  # field 2, wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def data_frame(payload: bytes | memoryview) -> bytes:
    """The encoded message carrying ``payload`` as its data: tag, length, payload (one copy of the payload)."""
    return b"".join((bytes((_DATA_TAG,)), _varint(len(payload)), payload))


def data_frames(data: bytes | memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """``data`` cut into data frames of at most ``chunk_bytes`` of payload each."""
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield data_frame(view[start:start + chunk_bytes])


def frame_payload_bytes(frame: bytes) -> int:
    """The payload size of a frame made by :func:`data_frame`."""
    return len(frame) - _payload_offset(frame)


def _payload_offset(raw: bytes) -> int:
    """Where the payload of a data frame starts, or -1 if ``raw`` is not exactly one data frame."""
    if len(raw) < 2 or raw[0] != _DATA_TAG:
        return -1
    length, shift, position = 0, 0, 1
    while position < len(raw) and position <= 10:
        byte = raw[position]
        length |= (byte & 0x7F) << shift
        position += 1
        if not byte & 0x80:
            return position if position + length == len(raw) else -1
        shift += 7
    return -1


class DataFrame:
    """A data chunk read without protobuf; it answers what the code reading the messages asks of them."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview):
        self.data = data

    @staticmethod
    def WhichOneof(_group: str) -> str:  # noqa: N802 - protobuf's name
        return "data"


def carries_data(message_type: Any) -> bool:
    """Whether field 2 of ``message_type`` is its ``bytes data`` (the messages that carry tensor chunks)."""
    field = message_type.DESCRIPTOR.fields_by_number.get(2)
    return field is not None and field.name == "data" and field.type == field.TYPE_BYTES


def deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """Parse a message of ``message_type``: a data frame as a view of the bytes, anything else by protobuf."""
    if not carries_data(message_type):
        parse_message: Callable[[bytes], Any] = message_type.FromString
        return parse_message

    def parse(raw: bytes) -> Any:
        offset = _payload_offset(raw)
        if offset > 0:
            return DataFrame(memoryview(raw)[offset:])
        return message_type.FromString(raw)

    return parse


def serialize(message: Any) -> bytes:
    """A data frame is already encoded; any other message is serialized by protobuf."""
    return message if isinstance(message, bytes) else message.SerializeToString()
