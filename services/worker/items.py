"""What a push stream carries of each block: typed, for the gRPC stream and the data channel alike."""
from __future__ import annotations

import dataclasses

import torch

from imerge.core.compression import Payload


@dataclasses.dataclass(frozen=True)
class PushOptions:
    """What a push of one block says about its round besides the gradient."""

    hypers: str = ""                # the param group's hyperparameters that differ from the initial ones (JSON)
    no_grad: tuple[int, ...] = ()   # the block's pieces this worker gave no gradient
    assign: bool = False            # the data are parameters to assign (load_state_dict), not a gradient
    loss_scale: float = 0.0         # the gradient is scaled by this (grad scaler); 0: not
    max_norm: float = 0.0           # clip the round's averaged gradient to this global norm; 0: no clipping
    clip_value: float = 0.0         # clamp the round's averaged gradient's elements to +-this first; 0: not


NO_OPTIONS = PushOptions()


@dataclasses.dataclass(frozen=True)
class PushItem:
    """One block of a push stream: its gradient (an fp32 tensor, or a compressed :class:`Payload`), the round it
    is of, and what the push says besides."""

    block_id: str
    grad: torch.Tensor | Payload
    round: int
    options: PushOptions = NO_OPTIONS

    @property
    def payload(self) -> Payload:
        return self.grad if isinstance(self.grad, Payload) else Payload(self.grad)
