"""A checkpoint's tensor file, written past the page cache: the safetensors format, streamed with ``O_DIRECT``.

Pure: imports neither grpc nor redis. ``safetensors``' own ``save_file`` writes through the page cache: the
kernel copies every byte into freshly allocated pages, writes them back later (in the flusher's threads or in
the writer's ``fsync``) and frees them again when the checkpoint is pruned: a shard that checkpoints 33.6 MB
every 10 rounds spent 15% of its CPU on its checkpoints (``docs/benchmarks.md``). Here the tensors are copied
(``memmove`` through ctypes: one thread, the interpreter lock released) into a page-aligned staging buffer,
each filled chunk's CRC-32 is taken while it is in the cache (zlib-ng's, 5x zlib's speed here), and the chunk
is written with ``O_DIRECT``: the disk reads it from the buffer. Where the file system refuses ``O_DIRECT``
(some network and FUSE file systems, tmpfs on older kernels) the same chunks go through the page cache.
Either way the file is a plain safetensors file (its header as the format defines it, padded so that the data
start 8-aligned), read back with ``safetensors.torch.load_file``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import logging
import mmap
import os
import threading
from pathlib import Path

import torch
from zlib_ng.zlib_ng import crc32

log = logging.getLogger(__name__)
ALIGN = 4096          # O_DIRECT's alignment of offsets, lengths and memory (a multiple of any logical block size)
CHUNK = 4 << 20       # the staging buffer: what is copied, checksummed and written at a time
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",  # safetensors'
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
          torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
          torch.float8_e5m2: "F8_E5M2", torch.float8_e5m2fnuz: "F8_E5M2FNUZ"}
_staging = threading.local()  # a writer thread's staging buffer, kept from one checkpoint to the next
_refused: set[int] = set()    # devices whose file system refused O_DIRECT (said once in the log)


@dataclasses.dataclass(frozen=True)
class Written:
    """A tensor file as written: its size, the CRC-32 of its bytes, and whether it bypassed the page cache."""

    size: int
    crc32: int
    direct: bool


def header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The file's first bytes: the header's length (8 bytes, little-endian) and the JSON header naming each
    tensor's dtype, shape and byte range, in the order of their names (as the data follow it). A tensor the
    file cannot hold (a dtype safetensors has no name for, memory not on the CPU) raises ValueError naming it."""
    entries: dict[str, object] = {}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        dtype = DTYPES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {name}: on {tensor.device}, not in the CPU's memory")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class _Stream:
    """The file being written: the staging buffer, how much of it is filled, the bytes and CRC so far."""

    def __init__(self, fd: int, direct: bool):
        self.fd, self.direct = fd, direct
        self.buffer = _staging_buffer()
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.filled = self.size = self.crc32 = 0

    def put(self, data: torch.Tensor) -> None:
        """Append ``data`` (uint8, one dimension) to the file."""
        done, total = 0, data.numel()
        while done < total:
            count = min(CHUNK - self.filled, total - done)
            ctypes.memmove(self.address + self.filled, data.data_ptr() + done, count)
            self.filled, done = self.filled + count, done + count
            if self.filled == CHUNK:
                self.flush()

    def flush(self) -> None:
        """Write what is staged (the last chunk padded to ALIGN under O_DIRECT: ``finish`` cuts the file)."""
        view = memoryview(self.buffer)
        self.crc32 = crc32(view[:self.filled], self.crc32)
        length = -(-self.filled // ALIGN) * ALIGN if self.direct else self.filled
        written = 0
        while written < length:
            written += os.write(self.fd, view[written:length])
        self.size, self.filled = self.size + self.filled, 0

    def finish(self) -> None:
        self.flush()
        if self.direct and self.size % ALIGN:
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)


def _staging_buffer() -> mmap.mmap:
    buffer = getattr(_staging, "buffer", None)
    if buffer is None:
        buffer = _staging.buffer = mmap.mmap(-1, CHUNK)  # anonymous memory: page-aligned
    return buffer


def _open(path: Path, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    return os.open(path, flags | os.O_DIRECT if direct else flags, 0o644)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], direct: bool = True) -> Written:
    """Write ``tensors`` to ``path`` as a safetensors file, fsynced; its size and CRC-32. ``direct``: bypass the
    page cache where the file system allows it."""
    head = header(tensors)  # before the file exists: a tensor it cannot hold leaves none behind
    device = os.stat(path.parent).st_dev
    direct = direct and hasattr(os, "O_DIRECT") and device not in _refused
    try:
        return _write(path, head, tensors, direct)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
    if device not in _refused:
        _refused.add(device)
        log.info("checkpoints in %s go through the page cache: its file system refuses O_DIRECT", path.parent)
    return _write(path, head, tensors, False)


def _write(path: Path, head: bytes, tensors: dict[str, torch.Tensor], direct: bool) -> Written:
    fd = _open(path, direct)
    try:
        stream = _Stream(fd, direct)
        stream.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for name in sorted(tensors):
            tensor = tensors[name]
            if tensor.numel():
                stream.put(tensor.reshape(-1).view(torch.uint8))  # a non-contiguous one: copied here
        stream.finish()
        return Written(stream.size, stream.crc32, direct)
    finally:
        os.close(fd)
