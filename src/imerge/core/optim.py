"""The optimizer that runs on the PS shards: any ``torch.optim`` optimizer, by name, with its keyword arguments.

The shard builds it over one parameter per piece of a model parameter its block
holds (views into the block's flat tensor), so every piece keeps its own state
(Adam's step count, momentum) and a piece that no worker gave a gradient is
skipped exactly as ``torch.optim`` skips a parameter whose ``grad`` is None.

A spec may carry parameter groups: each group's keyword arguments override the
spec's (``weight_decay`` 0 for biases and norms, say); every block belongs to
one group. The hyperparameters a training loop changes between steps (an LR
scheduler's ``lr``, ``momentum``, ``betas``) travel with each round's pushes as
:func:`hyper_delta` of the group's values.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from imerge.core.config import env_name, parse_value
from imerge.core.errors import InvalidArgument
from imerge.core.limits import clip
from imerge.core.optim_args import (checked_arguments, checked_hypers, parse_json_object, state_layout,
                                    trial_problem)

REFUSED = {"lbfgs": "needs a closure that re-evaluates the model", "sparseadam": "needs sparse gradients",
           "muon": "works on each parameter's matrix shape, which a shard's flat pieces do not keep",
           "adafactor": "works on each parameter's matrix shape, which a shard's flat pieces do not keep"}
Scalar = float | int | bool | tuple[Any, ...]


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class of ``torch.optim`` by lower-case name (``sgd``, ``adam``, ``adamw``, ``rmsprop``, ...)."""
    return {name.lower(): cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}


OPTIMIZERS = tuple(sorted(set(optimizer_classes()) - set(REFUSED)))


def check_without_dynamo() -> None:
    """Let this process build optimizers (to check a spec's arguments) without importing ``torch._dynamo``, 1.2 s
    of CPU: torch.optim wraps ``add_param_group``, ``zero_grad`` and the state-dict methods in
    ``torch._disable_dynamo``, which imports it at their first call to keep them out of torch.compile's graphs.
    Marking each wrapped function as its own disabled form skips that. Only for IMerge's own processes, which
    never compile (``imerge launch``, ``testbed`` and ``bench``, which check the job's options before starting
    its roles; ``imerge worker``: the built-in job, or the parent of a script's process; ``imerge ps``, whose
    trial and probe steps go through :func:`.optim_args.eager_step`, so a shard whose steps are native never
    imports it); never in a training script's process. A torch that caches differently just imports it as
    before."""
    for cls in (torch.optim.Optimizer, *optimizer_classes().values()):
        for value in vars(cls).values():
            wrapped, code = getattr(value, "__wrapped__", None), getattr(value, "__code__", None)
            if wrapped is not None and code is not None and code.co_filename.endswith("_compile.py"):
                setattr(wrapped, "__dynamo_disable", wrapped)


def _frozen(value: Any) -> Any:
    """A hashable, JSON-stable form of a keyword argument (lists become tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _options(raw: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((str(k), _frozen(v)) for k, v in raw.items()))


class OptimizerSpec:
    """``OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)``: ``torch.optim.AdamW`` with those arguments.

    ``groups`` lists parameter groups' overrides (``[{"weight_decay": 0.0}]``); which parameters belong to which
    group is the caller's (see :mod:`imerge.worker.api`); group 0 is the spec itself unless ``groups`` says.
    The legacy ``beta1``/``beta2`` arguments become ``betas``.
    """

    __slots__ = ("name", "options", "groups")
    name: str
    options: tuple[tuple[str, Any], ...]
    groups: tuple[tuple[tuple[str, Any], ...], ...]

    def __init__(self, name: str = "sgd", groups: Sequence[Mapping[str, Any]] = (), **options: Any):
        if "beta1" in options or "beta2" in options:
            options["betas"] = (options.pop("beta1", 0.9), options.pop("beta2", 0.999))
        options.setdefault("lr", 0.01)
        object.__setattr__(self, "name", str(name).lower())
        object.__setattr__(self, "options", _options(options))
        object.__setattr__(self, "groups", tuple(_options(g) for g in groups))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("OptimizerSpec is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptimizerSpec) and (self.name, self.options, self.groups) == (
            other.name, other.options, other.groups)

    def __hash__(self) -> int:
        return hash((self.name, self.options, self.groups))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options)
        groups = f", groups={[dict(g) for g in self.groups]}" if self.groups else ""
        return f"OptimizerSpec({self.name!r}, {args}{groups})"

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def lr(self) -> float:
        return float(self.kwargs["lr"])

    def replace(self, **options: Any) -> "OptimizerSpec":
        return OptimizerSpec(self.name, [dict(g) for g in self.groups], **{**self.kwargs, **options})

    def group(self, index: int) -> "OptimizerSpec":
        """The spec of parameter group ``index`` alone (its overrides applied, no groups)."""
        if not 0 <= index < self.num_groups:
            raise InvalidArgument(f"optimizer has no parameter group {index} (it has {self.num_groups})")
        overrides = dict(self.groups[index]) if self.groups else {}
        return OptimizerSpec(self.name, **{**self.kwargs, **overrides})

    @property
    def num_groups(self) -> int:
        return max(len(self.groups), 1)

    # -- building ---------------------------------------------------------------------
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        if self.name in REFUSED:
            raise InvalidArgument(f"optimizer {self.name!r} is not supported on the shards: it {REFUSED[self.name]}")
        try:
            return optimizer_classes()[self.name]
        except KeyError:
            raise InvalidArgument(f"optimizer {self.name!r} is not one of torch.optim's: "
                                  f"{', '.join(OPTIMIZERS)}") from None

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (of a single group: use :meth:`group` first); InvalidArgument names a bad
        keyword argument or value."""
        cls = self.optimizer_class()
        if self.groups:
            raise InvalidArgument("build one parameter group at a time (OptimizerSpec.group)")
        try:
            return cls(list(params), **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - torch's checks raise TypeError, ValueError, IndexError, ...
            raise InvalidArgument(f"invalid optimizer {self!r}: {type(exc).__name__}: {exc}") from None

    def validate(self, step: bool = False) -> "OptimizerSpec":
        """Return self, or raise InvalidArgument naming the bad name, argument or value (with ``step``, also
        what the optimizer's first step refuses: see :mod:`imerge.core.optim_args`)."""
        for index in range(self.num_groups):
            spec = self.group(index)
            if not (isinstance(spec.kwargs["lr"], (int, float)) and spec.kwargs["lr"] > 0):
                raise InvalidArgument(f"invalid optimizer: lr must be a positive number, got {spec.kwargs['lr']!r}")
            checked_arguments(spec.optimizer_class(), spec.kwargs, "invalid optimizer", step)
        return self

    def state_layout(self) -> tuple[tuple[str, int, str], ...]:
        """(name, dimensions, dtype) of each state tensor this (single-group) optimizer keeps per piece."""
        return state_layout(self.optimizer_class(), self.options)

    def check_hypers(self, initial: Mapping[str, Any], delta_json: str, what: str) -> dict[str, Scalar]:
        """The hyperparameters a round's ``delta_json`` sets, checked as :func:`parse_hypers` does and then by
        building and stepping this (single-group) optimizer with them, so that the shard's step cannot raise."""
        parsed = parse_hypers(initial, delta_json, what)
        if parsed:
            problem = trial_problem(self.optimizer_class(), tuple(sorted({**self.kwargs, **parsed}.items())))
            if problem:
                raise InvalidArgument(f"{what}: hyperparameters {clip(delta_json, 200)}: {problem}")
        return parsed

    def defaults(self) -> dict[str, Any]:
        """Every hyperparameter of the optimizer, its class defaults overridden by this spec (group 0)."""
        return dict(self.group(0).build([torch.nn.Parameter(torch.zeros(1))]).defaults)

    # -- wire ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"name": self.name, "options": dict(self.options),
                           "groups": [dict(g) for g in self.groups]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OptimizerSpec":
        try:
            raw = json.loads(text)
            return cls(raw["name"], raw.get("groups", ()), **raw["options"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"unreadable optimizer spec {text[:200]!r}: {exc}") from None

    @classmethod
    def from_env(cls, default: "OptimizerSpec | None" = None,
                 env: Mapping[str, str] | None = None) -> "OptimizerSpec":
        """``default`` (plain SGD, lr 0.01 if None) with the optimizer options of the environment:
        ``IMERGE_OPTIMIZER``, ``IMERGE_LR``, ``IMERGE_MOMENTUM``, ``IMERGE_WEIGHT_DECAY``, ``IMERGE_NESTEROV`` and
        ``IMERGE_OPTIMIZER_ARGS`` (JSON keyword arguments): what ``imerge launch --optimizer adam --lr 3e-4 --
        python train.py`` passes to the script. A different optimizer name starts from that optimizer's
        defaults."""
        env = os.environ if env is None else env
        spec = default or cls()
        name = env.get(env_name("optimizer"), "").strip().lower()
        if name and name != spec.name:
            spec = cls(name)
        kinds = {"lr": float, "momentum": float, "weight_decay": float, "nesterov": bool}
        values = {field: parse_value(kind, env[env_name(field)], env_name(field)) for field, kind in kinds.items()
                  if env.get(env_name(field), "") != ""}
        extra = env.get(env_name("optimizer_args"), "").strip()
        if extra:
            try:
                values.update(json.loads(extra))
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"{env_name('optimizer_args')}: not a JSON object: {exc}") from None
        return spec.replace(**values)


# -- hyperparameters that change between steps ------------------------------------------
def scalar_hypers(group: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Scalar]:
    """The numeric hyperparameters of a param group (``keys``: the optimizer's defaults)."""
    values = {}
    for key in keys:
        value = _frozen(group.get(key))
        if isinstance(value, bool) or isinstance(value, (int, float)) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            values[key] = value
    return values


def hyper_delta(current: Mapping[str, Scalar], initial: Mapping[str, Scalar]) -> str:
    """The hyperparameters that differ from their initial values, as canonical JSON ("" when none)."""
    delta = {k: v for k, v in current.items() if initial.get(k) != v}
    return json.dumps(delta, sort_keys=True) if delta else ""


def parse_hypers(initial: Mapping[str, Any], delta_json: str, what: str = "push") -> dict[str, Scalar]:
    """The hyperparameters ``delta_json`` sets; InvalidArgument names an unknown key, a value of the wrong kind,
    a flag that changed, or JSON too large or too deep (see :mod:`imerge.core.optim_args`)."""
    if not delta_json:
        return {}
    return checked_hypers(initial, parse_json_object(delta_json, f"{what}: hyperparameters"), what)


def apply_hypers(optimizer: torch.optim.Optimizer, initial: Mapping[str, Any], delta_json: str) -> None:
    """Set every param group's hyperparameters: the initial ones, then those ``delta_json`` changes."""
    values = {**initial, **parse_hypers(initial, delta_json)}
    for group in optimizer.param_groups:
        group.update(values)
