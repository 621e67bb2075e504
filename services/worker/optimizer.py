"""The shards' optimizer as the training loop sees it: ``model.optimizer``.

The optimizer runs on the shards, during backward. :class:`ShardOptimizer` is
a ``torch.optim.Optimizer`` over the model's parameters whose ``param_groups``
are the ones each round's pushes carry: any ``torch.optim.lr_scheduler`` (or a
loop that sets ``group["lr"]``) works unchanged, and its values reach the
shards with the next backward. ``step()`` and ``zero_grad()`` have nothing
left to do (gradients were pushed and cleared in backward) and may be called
as in any loop.

A training script may instead hand ``imerge.distribute`` the ``torch.optim``
optimizer it built (with its parameter groups): :func:`spec_of` reads its
class, arguments and groups, and the proxy shares that optimizer's
``param_groups``, so a scheduler attached to either one drives the shards.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from imerge.core.errors import InvalidArgument, UnsupportedUse
from imerge.core.optim import OptimizerSpec, hyper_delta, optimizer_classes, scalar_hypers


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
    raise UnsupportedUse("the optimizer's state lives on the shards, not in this process: save and load it with "
                         "imerge.save(model, path) and imerge.load(model, path)")


class ShardOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands itself to step(), which refuses it

    def __init__(self, spec: OptimizerSpec, groups: Sequence[Sequence[torch.nn.Parameter]],
                 shared: torch.optim.Optimizer | None = None):
        self.spec = spec
        defaults = spec.defaults()
        super().__init__([{"params": list(params), **spec.group(index).kwargs} for index, params in enumerate(groups)],
                         defaults)
        if shared is not None:  # the script's own optimizer: a scheduler attached to it drives the shards too
            self.param_groups = shared.param_groups
            shared.register_state_dict_pre_hook(_state_lives_on_the_shards)
            shared.register_load_state_dict_pre_hook(_state_lives_on_the_shards)
        self.hyper_keys = list(defaults)
        self.initial = [scalar_hypers(spec.group(index).build([torch.nn.Parameter(torch.zeros(1))]).param_groups[0],
                                      self.hyper_keys) for index in range(len(groups))]

    def state_dict(self) -> dict[str, Any]:
        _state_lives_on_the_shards()
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _state_lives_on_the_shards()

    def hypers(self) -> list[str]:
        """Each parameter group's hyperparameters that differ from the initial ones, as the pushes carry them."""
        return [hyper_delta(scalar_hypers(group, self.hyper_keys), initial)
                for group, initial in zip(self.param_groups, self.initial)]

    def lr(self, group: int) -> float:
        return float(self.param_groups[group]["lr"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """Nothing to do: the shards stepped during backward. A closure (LBFGS-style) cannot be re-evaluated;
        torch.amp.GradScaler cannot unscale gradients that already left (use ``model.grad_scaler()``)."""
        if closure is not None:
            raise UnsupportedUse("model.optimizer.step(closure): the shards step during backward and cannot "
                                 "re-evaluate a closure")
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:  # torch's old and new ways
            raise UnsupportedUse("torch.amp.GradScaler with IMerge: the gradients were pushed, scaled, during "
                                 "backward, and the shards applied them unscaled; use scaler = model.grad_scaler() "
                                 "(the same API), whose scale travels with the pushes")
        return None
