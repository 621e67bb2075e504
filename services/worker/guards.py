"""torch's gradient-clipping functions on a distributed model's parameters, done the PS way.

The gradients leave for the shards during backward, so a DDP loop's
``torch.nn.utils.clip_grad_norm_(model.parameters(), m)`` after backward would
find them gone and clip nothing. While a model is distributed, these functions
hand a call over the model's parameters to its engine, which has the shards
clip that round (:mod:`.clipping`) and returns what torch returns: the total
norm of the averaged gradient (``clip_grad_norm_``), nothing
(``clip_grad_value_``). For any other tensors they are torch's own. They are
installed when the first model is distributed (:mod:`.torch_patches`). A
script that bound torch's function itself before (``from torch.nn.utils import clip_grad_norm_`` at its
top) keeps torch's own, which would clip only this worker's ``.grad``: the
helpers torch's functions call (looked up in their module at each call) refuse
the model's gradients, naming the fix.
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from imerge.core.errors import UnsupportedUse

from . import clipping, exiting

if TYPE_CHECKING:
    from .engine import SyncEngine

GUARDED = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_")
HELPERS = ("_get_total_norm", "_group_tensors_by_device_and_dtype")  # what torch's own clipping functions call
_distributed: dict[int, tuple[weakref.ref[torch.nn.Parameter], weakref.ref[SyncEngine]]] = {}  # id(param) -> it, its engine
_accumulators: dict[int, weakref.ref[SyncEngine]] = {}  # data_ptr of an engine's gradient accumulator -> the engine
_originals: dict[tuple[ModuleType, str], Callable[..., Any]] = {}  # (module, name) -> torch's, while replaced


def _has_model_grads(tensors: Any) -> bool:
    """Whether ``tensors`` (a list of tensors, or of lists of them) holds a distributed model's ``.grad``."""
    for item in tensors if isinstance(tensors, (list, tuple)) else ():
        if isinstance(item, (list, tuple)) and _has_model_grads(item):
            return True
        if isinstance(item, torch.Tensor) and item.untyped_storage().data_ptr() in _accumulators:
            return True
    return False


def _refusing_model_grads(helper: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(helper)
    @exiting.reaching_the_script
    def refusing(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if _has_model_grads(tensors):
            raise UnsupportedUse("torch's gradient clipping over an IMerge model's gradients through a function "
                                 "bound before imerge.distribute (from torch.nn.utils import clip_grad_norm_, say): "
                                 "it would clip only this worker's .grad, which the shards never see; call it as "
                                 "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (or "
                                 "clip_grad_value_), which IMerge hands to the shards")
        return helper(tensors, *args, **kwargs)

    refusing.imerge_guarded = True  # type: ignore[attr-defined]
    return refusing


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


def install() -> None:
    """Put the distributed clipping functions and the refusing helpers in torch's modules (once; see
    :mod:`.torch_patches`)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in GUARDED:
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "imerge_guarded", False):
                _originals[(module, name)] = original
                setattr(module, name, _distributed_clip(original, name))
    for name in HELPERS:
        helper = getattr(torch.nn.utils.clip_grad, name, None)
        if helper is not None and not getattr(helper, "imerge_guarded", False):
            _originals[(torch.nn.utils.clip_grad, name)] = helper
            setattr(torch.nn.utils.clip_grad, name, _refusing_model_grads(helper))


def remove() -> None:
    """torch's own clipping functions and helpers back in its modules."""
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


def guard(engine: SyncEngine) -> None:
    """The engine's parameters are clipped through it from now on (the functions are installed)."""
    _distributed.update({id(p): (weakref.ref(p), weakref.ref(engine)) for p in engine.params})
    _accumulators[engine.flat.grads.untyped_storage().data_ptr()] = weakref.ref(engine)


def release(engine: SyncEngine) -> None:
    """The engine's parameters are torch's own again (it closed, or this process is a forked child)."""
    _accumulators.pop(engine.flat.grads.untyped_storage().data_ptr(), None)
    for param in engine.params:
        entry = _distributed.get(id(param))
        if entry is not None and entry[0]() is param:
            del _distributed[id(param)]
