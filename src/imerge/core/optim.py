"""The optimizer that runs on the PS shards, described by a small spec.

The shard applies it with ``torch.optim`` to each block's flat tensor, which
is element-wise the same as applying it to the original parameters.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from imerge.core.config import env_name, parse_value
from imerge.core.errors import InvalidArgument

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @classmethod
    def from_env(cls, default: "OptimizerSpec | None" = None,
                 env: Mapping[str, str] | None = None) -> "OptimizerSpec":
        """``default`` (plain SGD, lr 0.01 if None) with the optimizer options of the environment:
        ``IMERGE_OPTIMIZER``, ``IMERGE_LR``, ``IMERGE_MOMENTUM``, ``IMERGE_WEIGHT_DECAY``, ``IMERGE_NESTEROV``
        (what ``imerge launch --optimizer adam --lr 3e-4 -- python train.py`` passes to the script). A
        different optimizer name starts from that optimizer's defaults."""
        env = os.environ if env is None else env
        spec = default or cls()
        name = env.get(env_name("optimizer"), "").strip()
        if name and name != spec.name:
            spec = cls(name)
        kinds = {"lr": float, "momentum": float, "weight_decay": float, "nesterov": bool}
        values = {field: parse_value(kind, env[env_name(field)], env_name(field)) for field, kind in kinds.items()
                  if env.get(env_name(field), "") != ""}
        return dataclasses.replace(spec, **values)

    def validate(self) -> "OptimizerSpec":
        """Return self, or raise InvalidArgument naming the bad field."""
        problems = []
        if self.name not in OPTIMIZERS:
            problems.append(f"optimizer {self.name!r} is not one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            problems.append(f"lr must be positive, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            problems.append("momentum and weight_decay must be >= 0")
        if self.name != "sgd" and not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            problems.append(f"Adam needs betas in [0, 1) and eps > 0, got ({self.beta1}, {self.beta2}), {self.eps}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            problems.append("nesterov needs momentum > 0 and dampening 0")
        if problems:
            raise InvalidArgument("invalid optimizer: " + "; ".join(problems))
        return self

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        self.validate()
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                                   weight_decay=self.weight_decay, nesterov=self.nesterov)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                   weight_decay=self.weight_decay)
