"""What a client may pass as an optimizer's keyword arguments or as a round's hyperparameters. Pure.

Every value is checked against the kind of the optimizer's own default for that
argument (its ``__init__`` signature): a flag takes a bool, a number a finite
int or float (10**400 is none), a tuple (Adam's ``betas``,
Rprop's ``etas``) a tuple of as many numbers, an argument that defaults to None
(``foreach``, ``fused``) None or a bool. Then the optimizer is built with the
values over a two-element parameter and, on a shard, stepped once with a zero
gradient, so torch's own range checks (``lr >= 0``, ``0 <= betas[i] < 1``, ...)
and anything its step would raise on are met here, before a block is created
or a round counted, never by the shard's step. A round's hyperparameters may change
numbers and tuples, not flags (``amsgrad`` toggled mid-run has no state to
step with). JSON from a client is bounded in size and depth before it is
parsed.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from imerge.core.errors import InvalidArgument
from imerge.core.limits import MAX_OPTIONS_CHARS, clip

MAX_JSON_DEPTH = 3      # {"betas": [0.9, 0.999]} is depth 2
F = TypeVar("F", bound=Callable[..., Any])


def cached(maxsize: int | None) -> Callable[[F], F]:
    """functools.lru_cache keeping the function's signature for the type checker (an optimizer class is the key:
    hashable, though torch's stubs declare Optimizer's __hash__ for instances only)."""
    return cast(Callable[[F], F], functools.lru_cache(maxsize=maxsize))


def parse_json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` as a JSON object of at most MAX_OPTIONS_CHARS characters and MAX_JSON_DEPTH levels."""
    if len(text) > MAX_OPTIONS_CHARS:
        raise InvalidArgument(f"{what}: {len(text)} characters of JSON, more than {MAX_OPTIONS_CHARS}")
    depth = 0
    for char in text:  # before json.loads, which recurses once per level
        depth += (char in "[{") - (char in "]}")
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{what}: not JSON: {clip(str(exc), 200)}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: not a JSON object: {clip(text, 200)!r}")
    return value


@cached(None)
def signature_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The optimizer's keyword arguments and their defaults."""
    return {name: param.default for name, param in inspect.signature(cls.__init__).parameters.items()
            if name not in ("self", "params") and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)}


def _number(value: Any, what: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what}: {clip(repr(value), 100)} is not a number")
    try:
        magnitude = abs(float(value))
    except OverflowError:
        magnitude = math.inf
    if not math.isfinite(magnitude):  # NaN, infinity, or an integer no float holds (10**400)
        raise InvalidArgument(f"{what}: {clip(repr(value), 100)} is not a finite number")
    return value


def checked_value(value: Any, like: Any, what: str) -> Any:
    """``value`` (lists as tuples) if it is of the kind of ``like`` (the default or the initial value)."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(like, bool):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{what}: {clip(repr(value), 100)} is not a bool (true or false)")
        return value
    if like is None:
        if value is not None and not isinstance(value, bool):
            raise InvalidArgument(f"{what}: {clip(repr(value), 100)} is not null, true or false")
        return value
    if isinstance(like, (int, float)):
        return _number(value, what)
    if isinstance(like, tuple):
        if not isinstance(value, tuple) or len(value) != len(like):
            raise InvalidArgument(f"{what}: {clip(repr(value), 100)} is not a list of {len(like)} numbers")
        return tuple(_number(item, f"{what}[{index}]") for index, item in enumerate(value))
    raise InvalidArgument(f"{what}: cannot be set from a client (its default is {clip(repr(like), 60)})")


def checked_arguments(cls: type[torch.optim.Optimizer], options: Mapping[str, Any], what: str,
                      step: bool = True) -> None:
    """Refuse an argument the optimizer does not take or a value unlike its default, then build it and (with
    ``step``: where the process steps the optimizer anyway) step it once."""
    defaults = signature_defaults(cls)
    checked = {}
    for key, value in options.items():
        if key not in defaults:
            raise InvalidArgument(f"{what}: {cls.__name__} takes no argument {clip(str(key), 60)!r} "
                                  f"(it takes {', '.join(defaults)})")
        checked[key] = checked_value(value, defaults[key], f"{what}: {cls.__name__} argument {key!r}")
    problem = trial_problem(cls, tuple(sorted(checked.items())), step)
    if problem:
        raise InvalidArgument(f"{what}: {problem}")


def eager_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` as torch's step function computes it, without the two wrappers torch puts around it:
    the graph breaks for torch.compile, whose first call imports ``torch._dynamo`` (1.2 s of CPU), and the step
    hooks and profiler label. For optimizers that no hook was registered on and that are never compiled: the
    ones built to check or probe a spec, and a shard's (the trials of every process, and a shard's steps). The
    grad mode is the wrapper's: on only for a ``differentiable`` optimizer."""
    step = inspect.unwrap(type(optimizer).step)
    with torch.set_grad_enabled(bool(optimizer.defaults.get("differentiable", False))):
        step(optimizer)


@cached(512)
def trial_problem(cls: type[torch.optim.Optimizer], options: tuple[tuple[str, Any], ...], step: bool = True) -> str:
    """Why torch refuses to build the optimizer with ``options`` or (``step``) to step it once ("" if it does
    not)."""
    piece = torch.nn.Parameter(torch.zeros(2))
    try:
        optimizer = cls([piece], **dict(options))
        if step:
            piece.grad = torch.zeros(2)
            eager_step(optimizer)
    except Exception as exc:  # noqa: BLE001 - torch's own checks raise ValueError, TypeError, RuntimeError, ...
        return f"{cls.__name__} refuses {clip(str(dict(options)), 300)}: {type(exc).__name__}: {clip(str(exc), 300)}"
    return ""


def checked_hypers(initial: Mapping[str, Any], delta: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A round's changed hyperparameters, each of its initial value's kind; flags may not change."""
    parsed = {}
    for key, value in delta.items():
        if key not in initial:
            raise InvalidArgument(f"{what}: hyperparameter {clip(str(key), 60)!r} is not one of the optimizer's: "
                                  f"{sorted(initial)}")
        value = checked_value(value, initial[key], f"{what}: hyperparameter {key!r}")
        if isinstance(initial[key], bool) and value != initial[key]:
            raise InvalidArgument(f"{what}: hyperparameter {key!r} is a flag set when the optimizer was built "
                                  f"({initial[key]}); it cannot change mid-run")
        if key == "lr" and value < 0:
            raise InvalidArgument(f"{what}: learning rate {value!r} is negative")
        parsed[key] = value
    return parsed


@cached(256)
def state_layout(cls: type[torch.optim.Optimizer], options: tuple[tuple[str, Any], ...]
                 ) -> tuple[tuple[str, int, str], ...]:
    """(name, dimensions, dtype) of each state tensor the optimizer keeps for a parameter once it stepped."""
    piece = torch.nn.Parameter(torch.zeros(2))
    optimizer = cls([piece], **dict(options))
    piece.grad = torch.zeros(2)
    eager_step(optimizer)
    return tuple(sorted((name, value.dim(), str(value.dtype).removeprefix("torch."))
                        for name, value in optimizer.state[piece].items() if isinstance(value, torch.Tensor)))
