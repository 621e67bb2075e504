"""The shards' optimizer as the training loop sees it: ``model.optimizer``.

The optimizer runs on the shards, during backward. :class:`ShardOptimizer` is
a ``torch.optim.Optimizer`` over the model's parameters whose ``param_groups``
are the ones each round's pushes carry: any ``torch.optim.lr_scheduler`` (or a
loop that sets ``group["lr"]``) works unchanged, and its values reach the
shards with the next backward. ``step()`` has nothing left to do (the
gradients were pushed in backward; ``.grad`` keeps this worker's until the
next forward) and may be called as in any loop; it counts the loop's steps.

The optimizer a training script builds (with its parameter groups), before or
after ``imerge.distribute`` (see :mod:`.adoption`), is read by :func:`spec_of`
(class, arguments, groups); the proxy shares its ``param_groups``, so a
scheduler attached to either one drives the shards, and its own ``step()``
finds no gradient (:class:`_NothingToStep`).
Under ``imerge launch``, :func:`check_launch_flags` makes sure the optimizer
flags given to the launcher reach the script's optimizer, or refuses.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from imerge.core.errors import ConfigError, InvalidArgument, UnsupportedUse
from imerge.core.optim import OptimizerSpec, hyper_delta, optimizer_classes, scalar_hypers
from imerge.core.planning import Layout, layout_of

from . import exiting
from .config import WorkerConfig


def spec_of(optimizer: torch.optim.Optimizer,
            params: Sequence[torch.nn.Parameter]) -> tuple[OptimizerSpec, dict[int, int]]:
    """The spec of a torch optimizer and the parameter group of each trainable parameter (by id)."""
    cls = type(optimizer)
    name = cls.__name__.lower()
    if optimizer_classes().get(name) is not cls:
        raise InvalidArgument(f"optimizer {cls.__qualname__} is not a torch.optim optimizer: the shards run "
                              f"torch.optim's classes only (by name)")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in group.items() if k in accepted} for group in optimizer.param_groups]
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    missing = [index for index, p in enumerate(params) if id(p) not in group_of]
    if missing:
        raise UnsupportedUse(f"{len(missing)} trainable parameters are in no parameter group of the optimizer "
                             f"(the first is #{missing[0]} in backward order): add them to a group, or freeze them "
                             "(requires_grad_(False)) so that IMerge does not train them either")
    return OptimizerSpec(name, groups if len(groups) > 1 else (), **{**defaults, **groups[0]}), group_of


def _state_lives_on_the_shards(*_: Any) -> None:
    raise UnsupportedUse("optimizer.load_state_dict() after imerge.distribute: the optimizer's state lives on the "
                         "shards; load it into the optimizer before imerge.distribute (as a DDP script resumes), or "
                         "use imerge.save(model, path) and imerge.load(model, path)")


StateSource = Callable[[], dict[int, dict[str, torch.Tensor]]]  # id(param) -> its optimizer state, from the shards


def _with_shard_state(optimizer: torch.optim.Optimizer, source: "Callable[[], StateSource | None]",
                      state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's state_dict() of ``optimizer`` with the state the shards keep (read from them by this worker alone:
    rank 0 may call it on its own, as DDP scripts checkpoint), in torch's format and parameter numbering."""
    read = source()
    if read is None:  # not joined yet: no state anywhere but the (empty) local one
        return state_dict
    by_param = read()
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state_dict["state"] = {index: by_param[id(param)] for index, param in enumerate(params)
                           if by_param.get(id(param))}
    return state_dict


class _NothingToStep:
    """Around the script's own optimizer's step(): the shards stepped already, so it must find no gradient. The
    local gradients (``.grad``, which the loop may still read) are put aside for the step and back after it."""

    def __init__(self, optimizer: torch.optim.Optimizer, proxy: "ShardOptimizer"):
        self.aside: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.proxy = proxy
        optimizer.register_step_pre_hook(self.before)
        optimizer.register_step_post_hook(self.after)

    @exiting.reaching_the_script
    def before(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        _refuse_torch_scaler(optimizer)
        self.proxy.stepped()
        self.aside = [(param, param.grad) for group in optimizer.param_groups for param in group["params"]]
        for param, _grad in self.aside:
            param.grad = None

    def after(self, *_: Any) -> None:
        for param, grad in self.aside:
            param.grad = grad
        self.aside = []


def _refuse_torch_scaler(optimizer: Any) -> None:
    """A grad scaler that hands itself to step() or sets ``grad_scale`` on the optimizer is not torch.amp's (whose
    methods IMerge takes over, :mod:`.amp`): its scale never reached the shards."""
    if optimizer is None or getattr(optimizer, "grad_scale", None) is not None:
        raise UnsupportedUse("a grad scaler that is not a torch.amp.GradScaler stepped the IMerge optimizer: the "
                             "gradients were pushed, scaled, during backward, and the shards applied them unscaled; "
                             "use torch.amp.GradScaler (or model.grad_scaler()), whose scale travels with the pushes")


class ShardOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands itself to step(), which refuses it
    imerge_proxy = True  # not a second optimizer over the model's parameters (see .adoption)

    def __init__(self, spec: OptimizerSpec, groups: Sequence[Sequence[torch.nn.Parameter]],
                 shared: torch.optim.Optimizer | None = None):
        self.spec = spec
        defaults = spec.defaults()
        super().__init__([{"params": list(params), **spec.group(index).kwargs} for index, params in enumerate(groups)],
                         defaults)
        self.state_source: StateSource | None = None  # the engine's reader of the shards' state
        self.round_result: Callable[[], Any] = lambda: None  # the engine's: what the shards said of the latest round
        if shared is not None:  # the script's own optimizer: a scheduler attached to it drives the shards too
            self.param_groups = shared.param_groups
            shared.imerge_shards = self  # type: ignore[attr-defined]  # torch.amp.GradScaler finds the shards (.amp)
            shared.register_state_dict_post_hook(
                lambda optimizer, state_dict: _with_shard_state(optimizer, lambda: self.state_source, state_dict))
            shared.register_load_state_dict_pre_hook(_state_lives_on_the_shards)
            shared._step_supports_amp_scaling = True  # type: ignore[attr-defined]  # torch.amp.GradScaler then marks the optimizer before step()
            _NothingToStep(shared, self)
        self.on_step: Callable[[], None] | None = None  # the engine counts the script's steps
        self.hyper_keys = list(defaults)
        self.initial = [scalar_hypers(spec.group(index).build([torch.nn.Parameter(torch.zeros(1))]).param_groups[0],
                                      self.hyper_keys) for index in range(len(groups))]

    def state_dict(self) -> dict[str, Any]:
        """torch's format, with the shards' state (see :func:`_with_shard_state`)."""
        return _with_shard_state(self, lambda: self.state_source, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _state_lives_on_the_shards()

    def hypers(self) -> list[str]:
        """Each parameter group's hyperparameters that differ from the initial ones, as the pushes carry them."""
        if len(self.param_groups) != len(self.initial):
            raise UnsupportedUse(f"the optimizer has {len(self.param_groups)} parameter groups, the shards "
                                 f"{len(self.initial)}: add_param_group() after imerge.distribute is not supported "
                                 "(build the optimizer with every group first)")
        return [hyper_delta(scalar_hypers(group, self.hyper_keys), initial)
                for group, initial in zip(self.param_groups, self.initial)]

    def stepped(self) -> None:
        """The script called step() (this proxy's, or its own optimizer's)."""
        if self.on_step is not None:
            self.on_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each .grad views the accumulator, which the next forward zeroes once its push is out."""

    def lr(self, group: int) -> float:
        return float(self.param_groups[group]["lr"])

    @torch.no_grad()
    @exiting.reaching_the_script
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """Nothing to do: the shards stepped during backward. A closure (LBFGS-style) cannot be re-evaluated;
        torch.amp.GradScaler cannot unscale gradients that already left (use ``model.grad_scaler()``)."""
        if closure is not None:
            raise UnsupportedUse("model.optimizer.step(closure): the shards step during backward and cannot "
                                 "re-evaluate a closure")
        if grad_scaler is not None:
            _refuse_torch_scaler(None)
        _refuse_torch_scaler(self)
        self.stepped()
        return None


def shard_optimizer(module: torch.nn.Module, optimizer: OptimizerSpec | torch.optim.Optimizer
                    ) -> tuple[Layout, ShardOptimizer]:
    """The model's layout (each parameter in its optimizer group) and the optimizer proxy."""
    params = [p for _, p in module.named_parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        spec, group_of, shared = *spec_of(optimizer, params), optimizer
    elif isinstance(optimizer, OptimizerSpec):
        if optimizer.groups:
            raise InvalidArgument("an OptimizerSpec with parameter groups does not say which parameters belong to "
                                  "which group: pass the torch.optim optimizer built with those groups instead")
        spec, group_of, shared = optimizer, {}, None
    else:
        raise InvalidArgument(f"optimizer must be an imerge.OptimizerSpec or a torch.optim optimizer, not "
                              f"{type(optimizer).__name__}")
    spec.validate()
    layout = layout_of(module, group_of)
    groups = [[p for p in params if group_of.get(id(p), 0) == index] for index in range(spec.num_groups)]
    return layout, ShardOptimizer(spec, groups, shared)


def check_launch_flags(optimizer: OptimizerSpec | torch.optim.Optimizer | None, config: WorkerConfig,
                       env: dict[str, str] | None = None) -> OptimizerSpec | torch.optim.Optimizer:
    """The optimizer to use; ConfigError if the script overrides an option ``imerge launch`` was given."""
    from imerge.core.config import LAUNCH_FLAGS_ENV, env_name, flag_name, from_env

    env = dict(os.environ) if env is None else env
    given = {name for name in env.get(LAUNCH_FLAGS_ENV, "").split(",") if name}
    launched = from_env(WorkerConfig, env) if given & {f.name for f in dataclasses.fields(WorkerConfig)} else None
    for name in sorted(given):
        if launched is not None and hasattr(launched, name) and getattr(config, name) != getattr(launched, name):
            raise ConfigError(flag_name(name), f"imerge launch was given {getattr(launched, name)!r}, but the "
                                               f"script sets {getattr(config, name)!r}: drop one of them")
    if optimizer is None:
        return OptimizerSpec.from_env(env=env)
    flag_env = {env_name(n): env[env_name(n)] for n in given if env_name(n) in env}
    spec = optimizer if isinstance(optimizer, OptimizerSpec) else None
    if spec is None and isinstance(optimizer, torch.optim.Optimizer) and flag_env:
        spec = spec_of(optimizer, [p for g in optimizer.param_groups for p in g["params"]])[0]
    if spec is not None and OptimizerSpec.from_env(spec, flag_env) != spec:
        flags = " ".join(f"{flag_name(n)} {env[env_name(n)]}" for n in sorted(given) if env_name(n) in flag_env)
        raise ConfigError(flags, f"imerge launch was given these optimizer flags, but the script "
                                                  f"passes its own optimizer {optimizer}: build it with "
                                                  "imerge.OptimizerSpec.from_env(<defaults>) so the flags reach "
                                                  "it, or drop the flags")
    return optimizer
