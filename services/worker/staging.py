"""Between the device and the wire: when a group's gradients may be read, when pulled parameters may be used.

* CPU (:class:`HostStaging`): nothing is copied. The gradient accumulator is
  what a push sends (so it is not zeroed before the push is out); a pull
  writes the parameters themselves.
* CUDA (:class:`CudaStaging`): gradients accumulate in a flat device buffer.
  When a group completes in backward, one non-blocking copy of its slice into
  pinned host memory runs on a side stream, after the work the compute stream
  has queued so far; the hook returns at once, and the comm thread waits on
  the copy's event before it pushes. A pulled
  block goes back with one non-blocking copy on another side stream; the
  forward that needs it waits on that block's event on the GPU, never on a
  host synchronize, and the next forward that records gradients waits (on the
  GPU) for the copies before it zeroes the accumulator.

A staging hands out "ready" objects with ``query()`` (done?) and
``synchronize()`` (block until done): CUDA events, or :data:`DONE`.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from .buffers import FlatParams


class Ready(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = _Done()


class HostStaging:
    wire_reads_accumulator = True  # a push reads the accumulator itself: zero a slice only once it is out

    def __init__(self, flat: FlatParams):
        self.flat = flat

    def group_complete(self, offset: int, numel: int) -> Ready:
        """A group's gradients are complete in the accumulator (training thread): when may the wire read them?"""
        return DONE

    def wire_grads(self, offset: int, numel: int) -> torch.Tensor:
        """What a push sends of that range (host memory)."""
        return self.flat.grads[offset:offset + numel]

    def block_pulled(self, offset: int, numel: int) -> Ready:
        """A pulled block is in the host buffer (comm thread): when may a forward use it?"""
        return DONE

    def before_use(self, ready: Ready) -> None:
        """A forward is about to read a pulled block (training thread)."""

    def before_accumulate(self) -> None:
        """A forward that records gradients starts: the accumulator is about to be zeroed and accumulated into
        (training thread)."""


class CudaStaging(HostStaging):
    wire_reads_accumulator = False  # a push reads the pinned copy

    def __init__(self, flat: FlatParams):
        super().__init__(flat)
        self.d2h = torch.cuda.Stream(flat.device)
        self.h2d = torch.cuda.Stream(flat.device)

    def group_complete(self, offset: int, numel: int) -> Ready:
        computed = torch.cuda.Event()
        computed.record()  # the compute stream's work so far, this group's gradients included
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(computed)
            self.flat.host_grads[offset:offset + numel].copy_(self.flat.grads[offset:offset + numel],
                                                              non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return copied

    def wire_grads(self, offset: int, numel: int) -> torch.Tensor:
        return self.flat.host_grads[offset:offset + numel]

    def block_pulled(self, offset: int, numel: int) -> Ready:
        # after the compute work queued before the groups completed (which may still read the old parameters)
        self.h2d.wait_stream(self.d2h)
        with torch.cuda.stream(self.h2d):
            self.flat.values[offset:offset + numel].copy_(self.flat.host[offset:offset + numel], non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record()
        return loaded

    def before_use(self, ready: Any) -> None:
        if isinstance(ready, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ready)

    def before_accumulate(self) -> None:
        torch.cuda.current_stream().wait_stream(self.d2h)


def staging_for(flat: FlatParams) -> HostStaging:
    return CudaStaging(flat) if flat.device.type == "cuda" else HostStaging(flat)
