"""torch's gradient-clipping functions on a distributed model's parameters, done the PS way.

The gradients leave for the shards during backward, so a DDP loop's
``torch.nn.utils.clip_grad_norm_(model.parameters(), m)`` after backward would
find them gone and clip nothing. While a model is distributed, these functions
hand a call over the model's parameters to its engine, which has the shards
clip that round (:mod:`.clipping`) and returns what torch returns: the total
norm of the averaged gradient (``clip_grad_norm_``), nothing
(``clip_grad_value_``). For any other tensors they are torch's own. They are
installed when the first model is distributed: a script that bound the
function itself before (``from torch.nn.utils import clip_grad_norm_`` ahead
of ``imerge.distribute``) keeps torch's own, which clips only this worker's
``.grad`` (docs: porting).
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from imerge.core.errors import UnsupportedUse

from . import clipping, exiting

if TYPE_CHECKING:
    from .engine import SyncEngine

GUARDED = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_")
_distributed: dict[int, tuple[weakref.ref[torch.nn.Parameter], weakref.ref[SyncEngine]]] = {}  # id(param) -> it, its engine


def _engine_of(param: Any) -> SyncEngine | None:
    entry = _distributed.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _engine_for(params: list[torch.Tensor], name: str) -> SyncEngine | None:
    """The engine whose parameters the call clips (None: no distributed parameter in it); refuses a call that
    covers part of a model, or mixes its parameters with other tensors that have gradients."""
    engines = {id(engine): engine for engine in map(_engine_of, params) if engine is not None}
    if not engines:
        return None
    if len(engines) > 1:
        raise UnsupportedUse(f"torch.nn.utils.{name} over the parameters of two IMerge models in one call: clip each "
                             "model's parameters in a call of its own")
    engine = next(iter(engines.values()))
    trained = {id(p) for p in engine.params}
    given = {id(p) for p in params}
    if trained - given:
        raise UnsupportedUse(f"torch.nn.utils.{name} over {len(trained & given)} of the model's {len(trained)} "
                             "trained parameters: the shards clip each round over every trained parameter; pass "
                             "model.parameters()")
    if any(id(p) not in trained and p.grad is not None for p in params):
        raise UnsupportedUse(f"torch.nn.utils.{name} over the IMerge model's parameters and other tensors with "
                             "gradients: clip the model's parameters in a call of their own")
    return engine


def _distributed_clip(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    @exiting.reaching_the_script
    def clip(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = _engine_for(params, name)
        if engine is None:
            return original(params, *args, **kwargs)
        bound = signature.bind(params, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if name == "clip_grad_value_":
            engine.clip_value(arguments["clip_value"])
            return None
        norm = engine.clip_norm(clipping.check_norm_arguments(arguments["max_norm"], arguments["norm_type"]),
                                after_backward=True)
        if arguments.get("error_if_nonfinite") and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(arguments['norm_type'])} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=params[0].dtype, device=params[0].device)

    clip.imerge_guarded = True  # type: ignore[attr-defined]
    return clip


def guard(engine: SyncEngine) -> None:
    """Install the clipping functions once; the engine's parameters are clipped through it from now on."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in GUARDED:
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "imerge_guarded", False):
                setattr(module, name, _distributed_clip(original, name))
    _distributed.update({id(p): (weakref.ref(p), weakref.ref(engine)) for p in engine.params})


def release(params: Iterable[torch.nn.Parameter]) -> None:
    for param in params:
        entry = _distributed.get(id(param))
        if entry is not None and entry[0]() is param:
            del _distributed[id(param)]
