"""The worker's flat buffers: every trainable parameter is a view into one flat tensor.

Parameters are laid out in the plan's (backward) order, so every unit, block
and group is a contiguous range: a pull writes the parameters in place, with
no per-tensor copy, and a group's gradients are one slice of the gradient
accumulator. With T = 1 each parameter's ``.grad`` is a view of its slice
(DDP's ``gradient_as_bucket_view``): autograd accumulates straight into the
accumulator, and nothing is copied per gradient. On a GPU the accumulator and
the parameters stay on the device; :mod:`.staging` moves them to and from
pinned host buffers without blocking backward.
"""
from __future__ import annotations

import bisect

import torch

from imerge.core.planning import Block


class FlatParams:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.device = params[0].device
        total = sum(p.numel() for p in params)
        pinned = self.device.type == "cuda"
        self.values = torch.empty(total, device=self.device)
        self.host = torch.empty(total, pin_memory=True) if pinned else self.values
        self.grads = torch.zeros(total, device=self.device)  # the sum of gradients since the last sync
        self.host_grads = torch.empty(total, pin_memory=True) if pinned else self.grads  # what a push sends
        self.range: dict[int, tuple[int, int]] = {}
        offset = 0
        with torch.no_grad():
            for param in params:
                if param.device != self.device:
                    raise ValueError(f"all parameters must live on one device; {param.device} != {self.device}")
                view = self.values[offset:offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)
                self.range[id(param)] = (offset, param.numel())
                offset += param.numel()
        self._starts = [start for start, _ in self.range.values()]  # increasing: the layout's order
        self._ids = list(self.range)

    def pieces(self, block: Block) -> list[tuple[int, int]]:
        """(id(param), elements of it in the block) for every parameter the block holds a piece of, in order."""
        end = block.offset + block.numel
        first = max(0, bisect.bisect_right(self._starts, block.offset) - 1)
        pieces = []
        for pid in self._ids[first:]:
            start, numel = self.range[pid]
            if start >= end:
                break
            if block.offset < start + numel:
                pieces.append((pid, min(end, start + numel) - max(block.offset, start)))
        return pieces

    def host_slice(self, block: Block) -> torch.Tensor:
        return self.host[block.offset:block.offset + block.numel]

    def stage_to_host(self) -> None:
        if self.host is not self.values:
            self.host.copy_(self.values)

    def load_from_host(self, offset: int, numel: int) -> None:
        if self.host is not self.values:
            self.values[offset:offset + numel].copy_(self.host[offset:offset + numel])

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The parameter's slice of the gradient accumulator, in its shape (autograd accumulates into it)."""
        offset, numel = self.range[id(param)]
        return self.grads[offset:offset + numel].view_as(param)

    def add_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        offset, numel = self.range[id(param)]
        self.grads[offset:offset + numel].add_(grad.reshape(-1))
