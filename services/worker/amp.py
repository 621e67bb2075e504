"""Dynamic loss scaling for a model whose optimizer runs on the shards: ``model.grad_scaler()``.

It is a ``torch.amp.GradScaler`` (same arguments, same ``scale`` / ``step`` /
``update`` / ``state_dict``), with the work moved to where the gradients are:

* ``scale(loss)`` multiplies the loss as torch does and tells this backward's
  pushes the scale;
* the shards average the scaled gradients, unscale them (times the float32
  reciprocal of the scale, as ``unscale_`` does), and every shard skips the
  round's step if any found an inf or NaN;
* ``step(optimizer)`` reads whether the shards skipped the round (waiting for
  the first of its blocks to come back) and ``update()`` changes the scale with
  torch's own rule, so every worker's scale follows the same sequence.

``unscale_`` has nothing to do (clip with ``model.clip_grad_norm_``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from imerge.core.errors import UnsupportedUse

from . import exiting

if TYPE_CHECKING:
    from .engine import SyncEngine


class ShardGradScaler(torch.amp.GradScaler):
    def __init__(self, engine: Callable[[], SyncEngine], device: str = "cpu", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._engine = engine  # the model's engine (joining the job if it was not yet)

    @exiting.reaching_the_script
    def scale(self, outputs: Any) -> Any:
        scaled = super().scale(outputs)
        if self._enabled:
            self._engine().settings.loss_scale = self.get_scale()
        return scaled

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: the shards unscale the averaged gradient (clip with model.clip_grad_norm_)."""
        if self._enabled:
            self._per_optimizer_states[id(optimizer)]["stage"] = OptState.UNSCALED

    @exiting.reaching_the_script
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Whether the shards stepped this round; ``optimizer.step()`` (which has nothing left to do) runs only
        if they did, as with torch's scaler."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise UnsupportedUse("grad_scaler.step(closure=...): the shards step during backward")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        result = self._engine().last_round_result()
        if result is None:
            raise UnsupportedUse("grad_scaler.step() before any backward of the wrapped model")
        if self._scale is None:
            raise UnsupportedUse("grad_scaler.step() before grad_scaler.scale(loss)")
        device = self._scale.device
        state["found_inf_per_device"] = {device: torch.full((), float(result.skipped), device=device)}
        state["stage"] = OptState.STEPPED
        if result.skipped:  # the shards skipped the round; it still counts as the loop's step
            self._engine().stepped()
            return None
        return optimizer.step(*args, **kwargs)
