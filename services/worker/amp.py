"""Dynamic loss scaling for a model whose optimizer runs on the shards: torch's own ``torch.amp.GradScaler``,
unchanged, or ``model.grad_scaler()`` (the same class, checked against the job's options when it is made).

The work moves to where the gradients are:

* ``scale(loss)`` multiplies the loss as torch does and tells the coming
  backward's pushes the scale (for the models this thread trains);
* the shards average the scaled gradients, unscale them (times the float32
  reciprocal of the scale, as ``unscale_`` does), and every shard skips the
  round's step if any found an inf or NaN;
* ``unscale_(optimizer)`` has nothing left to do (clipping after it is the
  shards', :mod:`.clipping`);
* ``step(optimizer)`` reads whether the shards skipped the round (waiting for
  the first of its blocks to come back) and ``update()`` changes the scale with
  torch's own rule, so every worker's scale follows the same sequence.

For a scaler over any other optimizer, torch's methods run as they are.
:func:`install` puts these methods on ``torch.amp.GradScaler`` once, when the
first model is distributed, with IMerge's other patches (:mod:`.torch_patches`);
an instance made before keeps working, since methods are looked up on the class.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from imerge.core.errors import UnsupportedUse

from . import exiting

if TYPE_CHECKING:
    from .optimizer import ShardOptimizer


def shards_of(optimizer: Any) -> ShardOptimizer | None:
    """The shards' optimizer behind ``optimizer`` (the proxy itself, or the script's adopted one), else None."""
    if getattr(type(optimizer), "imerge_proxy", False):
        return optimizer  # type: ignore[no-any-return]
    return getattr(optimizer, "imerge_shards", None)


def refuse_scaling(compression: str, interleave_period: int, what: str) -> None:
    """Loss scaling cannot be done the PS way with these options: say why."""
    if interleave_period > 1:
        raise UnsupportedUse(f"{what} with --interleave-period > 1: groups sync in different iterations, so no "
                             "round holds the whole gradient")
    if compression in ("topk", "mixed"):
        raise UnsupportedUse(f"{what} with --compression {compression}: the top-k residual would keep gradients "
                             "of an old loss scale, and an overflow would stay in it for good; use --compression "
                             "fp16 or bf16 (or none) with a grad scaler")


def _scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @exiting.reaching_the_script
    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if self._enabled:
            for model in exiting.trained_here():
                refuse_scaling(model.config.compression, model.config.interleave_period, "a GradScaler")
                model.loop_settings.loss_scale = self.get_scale()
        return scaled

    return scale


def _unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    def unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled or shards_of(optimizer) is None:
            return original(self, optimizer)  # type: ignore[no-any-return]
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["stage"] = OptState.UNSCALED  # the shards unscale the averaged gradient
        return None

    return unscale_


def _step(original: Callable[..., Any]) -> Callable[..., Any]:
    @exiting.reaching_the_script
    def step(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        shards = shards_of(optimizer)
        if not self._enabled or shards is None:
            return original(self, optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise UnsupportedUse("GradScaler.step(closure=...): the shards step during backward")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if self._scale is None:
            raise UnsupportedUse("GradScaler.step() before GradScaler.scale(loss)")
        result = shards.round_result()
        if result is None:
            raise UnsupportedUse("GradScaler.step() before any backward of the wrapped model")
        device = self._scale.device
        state["found_inf_per_device"] = {device: torch.full((), float(result.skipped), device=device)}
        state["stage"] = OptState.STEPPED
        if result.skipped:  # the shards skipped the round; it still counts as the loop's step
            shards.stepped()
            return None
        return optimizer.step(*args, **kwargs)

    return step


_originals: dict[str, Callable[..., Any]] = {}  # method name -> torch's own, while replaced


def install() -> None:
    """Put the shards' way on torch.amp.GradScaler (once; see :mod:`.torch_patches`)."""
    cls = torch.amp.GradScaler
    if _originals:
        return
    _originals.update(scale=cls.scale, unscale_=cls.unscale_, step=cls.step)
    cls.scale = _scale(cls.scale)  # type: ignore[method-assign]
    cls.unscale_ = _unscale(cls.unscale_)  # type: ignore[method-assign]
    cls.step = _step(cls.step)  # type: ignore[method-assign]


def remove() -> None:
    """torch's own GradScaler methods back."""
    for name, original in _originals.items():
        setattr(torch.amp.GradScaler, name, original)
    _originals.clear()
