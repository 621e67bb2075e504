"""DDP's ``broadcast_buffers``: every worker runs each forward with the same model buffers.

BatchNorm's running statistics (and any other buffer) change in forward, on
each worker from its own data. After every backward that syncs, worker 0
publishes its buffers through the control store (only those that changed since
it last did), and every other worker copies them in before its next forward
(training or evaluation) and at ``close()``: mode ``broadcast``, DDP's default.
Mode ``average`` has every worker publish and take the mean, in rank order, of
the floating-point buffers (integer ones, such as ``num_batches_tracked``, come
from worker 0). Mode ``off`` leaves each worker its own.

Whatever the mode, when the job is joined and after ``imerge.load`` worker 0's
buffers and frozen parameters (those not trained, so outside the plan) become
every worker's, as DDP's construction broadcasts them (:meth:`BufferSync.share`).
"""
from __future__ import annotations

import torch
from safetensors.torch import load, save

from imerge.control.messages import ModuleState
from imerge.control.store import WorkerStore
from imerge.core.errors import UnsupportedUse

SHARED_STATE_TTL_S = 30 * 86400.0  # worker 0's state at the job's start: read again by workers restarted later


def encode(tensors: dict[str, torch.Tensor]) -> ModuleState:
    return ModuleState(save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}))


def decode(state: ModuleState) -> dict[str, torch.Tensor]:
    return load(state.data) if state.data else {}


class BufferSync:
    def __init__(self, module: torch.nn.Module, store: WorkerStore, *, rank: int, world_size: int, mode: str, generation: int,
                 timeout_s: float):
        self.module = module
        self.store, self.rank, self.world_size, self.mode = store, rank, world_size, mode
        self.generation, self.timeout_s = generation, timeout_s
        self.pending: int | None = None  # the iteration whose buffers are published but not yet applied here
        self._sent: dict[str, torch.Tensor] = {}  # worker 0's buffers as last published (broadcast)
        self.active = bool(self.buffers) and mode != "off" and world_size > 1

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())  # read each time: a module may replace a buffer

    def published(self, iteration: int) -> None:
        """After a synced backward: publish this worker's buffers if its mode says so."""
        if not self.active:
            return
        if self.mode == "average":
            self.store.publish_buffers(self.generation, iteration, self.rank, encode(self.buffers), self._ttl())
        elif self.rank == 0:
            changed = {name: b for name, b in self.buffers.items()
                       if name not in self._sent or not torch.equal(self._sent[name], b)}
            self.store.publish_buffers(self.generation, iteration, 0, encode(changed), self._ttl())
            self._sent.update({name: b.detach().clone() for name, b in changed.items()})
        self.pending = iteration

    def apply(self) -> None:
        """Before a forward (and at close): take the published buffers of the last synced backward."""
        if self.pending is None:
            return
        iteration, self.pending = self.pending, None
        if self.mode == "broadcast":
            if self.rank != 0:
                self._copy(decode(self.store.wait_buffers(self.generation, iteration, 0, self.timeout_s)))
            return
        published = [decode(self.store.wait_buffers(self.generation, iteration, rank, self.timeout_s))
                     for rank in range(self.world_size)]
        averaged = {}
        for name, first in published[0].items():
            if first.is_floating_point():
                total = first.clone()
                for other in published[1:]:
                    total.add_(other[name])
                averaged[name] = total.div_(self.world_size)
            else:
                averaged[name] = first
        self._copy(averaged)

    def share(self, tag: int, generation: int, frozen: dict[str, torch.nn.Parameter]) -> None:
        """Worker 0's ``frozen`` parameters (those outside the plan) and buffers become every worker's: it publishes
        them under ``tag``, the others copy them in (a restarted worker reads those of the job's start again)."""
        if self.world_size == 1:
            return
        if self.rank == 0:
            state = {**{f"param/{name}": p.detach().clone() for name, p in frozen.items()},
                     **{f"buffer/{name}": b.detach().clone() for name, b in self.buffers.items()}}
            self.store.publish_buffers(generation, tag, 0, encode(state), SHARED_STATE_TTL_S)
            return
        state = decode(self.store.wait_buffers(generation, tag, 0, self.timeout_s))
        params = {f"param/{name}": p for name, p in frozen.items()}
        targets = {**params, **{f"buffer/{name}": b for name, b in self.buffers.items()}}
        unknown = sorted(set(state) - set(targets))
        if unknown:
            raise UnsupportedUse(f"worker 0's {unknown[0].replace('/', ' ', 1)} is not a frozen parameter or buffer "
                                 f"of worker {self.rank}'s model: every worker must freeze the same parameters")
        for key, value in state.items():
            target = targets[key]
            if value.shape != target.shape or value.dtype != target.dtype:
                raise UnsupportedUse(f"worker 0's {key.replace('/', ' ', 1)} is {value.dtype} {list(value.shape)}, "
                                     f"worker {self.rank}'s {target.dtype} {list(target.shape)}: every worker must "
                                     "build the same model")
        with torch.no_grad():
            for key, value in state.items():
                targets[key].copy_(value)

    def _copy(self, values: dict[str, torch.Tensor]) -> None:
        buffers = self.buffers
        with torch.no_grad():
            for name, value in values.items():
                buffers[name].copy_(value)

    def _ttl(self) -> float:
        return max(600.0, 4 * self.timeout_s)
