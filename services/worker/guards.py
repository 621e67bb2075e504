"""Guards on the torch functions that would silently do nothing to a distributed model's gradients.

The gradients leave for the shards during backward, so a DDP loop's
``torch.nn.utils.clip_grad_norm_(model.parameters(), m)`` after backward would
find none and clip nothing. While a model is distributed, these functions
raise for its parameters, naming what to use instead; for any other tensors
they are torch's own. They are guarded when the first model is distributed:
a script that bound the function itself before (``from torch.nn.utils import
clip_grad_norm_`` ahead of ``imerge.distribute``) keeps torch's unguarded one.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from imerge.core.errors import UnsupportedUse

from . import exiting

INSTEAD = {"clip_grad_norm_": "model.clip_grad_norm_(max_norm), called before the first backward",
           "clip_grad_norm": "model.clip_grad_norm_(max_norm), called before the first backward",
           "clip_grad_value_": "nothing: clipping by value is not supported on the shards"}
_distributed: dict[int, weakref.ref[torch.nn.Parameter]] = {}  # id(param) -> the parameter, for every live distributed model


def _is_distributed(param: Any) -> bool:
    ref = _distributed.get(id(param))
    return ref is not None and ref() is param


def _guarded(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    @exiting.reaching_the_script
    def guarded(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(_is_distributed(p) for p in params):
            raise UnsupportedUse(f"torch.nn.utils.{name} on an IMerge model: its gradients were pushed to the "
                                 f"shards during backward, so it would find none and do nothing; use "
                                 f"{INSTEAD[name]}")
        return original(params, *args, **kwargs)

    guarded.imerge_guarded = True  # type: ignore[attr-defined]
    return guarded


def guard(params: Iterable[torch.nn.Parameter]) -> None:
    """Guard torch's gradient-clipping functions for ``params`` (installing the guards once)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in INSTEAD:
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "imerge_guarded", False):
                setattr(module, name, _guarded(original, name))
    _distributed.update({id(p): weakref.ref(p) for p in params})


def release(params: Iterable[torch.nn.Parameter]) -> None:
    for param in params:
        if _is_distributed(param):
            del _distributed[id(param)]
