"""What a push of one block says besides its bytes, as one typed value: parsed once where it arrives (the gRPC
header, the data channel's frame: :func:`imerge.wire.encoding.push_of`), encoded once where it leaves
(:func:`imerge.wire.encoding.push_header`), passed whole in between. Pure."""
from __future__ import annotations

import dataclasses
import math

from imerge.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class RoundOptions:
    hypers: str = ""         # hyperparameters that differ from the initial ones (JSON, "" when none)
    assign: bool = False     # the data are parameters to assign (load_state_dict): no step
    loss_scale: float = 0.0  # the gradients are scaled by this (dynamic loss scaling): unscale, skip on inf
    max_norm: float = 0.0    # clip the averaged gradient to this global L2 norm (0: no clipping)
    clip_value: float = 0.0  # clamp the averaged gradient's elements to [-clip_value, clip_value] first (0: not)

    def check(self, what: str) -> "RoundOptions":
        for name in ("loss_scale", "max_norm", "clip_value"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{what}: {name} {value} is not a finite number >= 0")
        return self

    @property
    def needs_agreement(self) -> bool:
        return not self.assign and (self.loss_scale > 0 or self.max_norm > 0)

    def disagreement(self, other: "RoundOptions") -> str:
        """What differs between two pushes' options of one round ("" when nothing does)."""
        if self.assign != other.assign:
            return ("an assignment and a gradient in one round: load_state_dict() must run at the same point of "
                    "the loop on every worker")
        if self.hypers != other.hypers:
            return (f"hyperparameters {self.hypers or '(the initial ones)'} and {other.hypers or '(the initial ones)'}"
                    ": the workers' learning-rate (or other) schedules disagree")
        if (self.loss_scale, self.max_norm, self.clip_value) != (other.loss_scale, other.max_norm, other.clip_value):
            return (f"loss scale {self.loss_scale:g} / max norm {self.max_norm:g} / clip value {self.clip_value:g} "
                    f"and {other.loss_scale:g} / {other.max_norm:g} / {other.clip_value:g}: the workers' grad "
                    "scalers or clipping disagree")
        return ""


NO_OPTIONS = RoundOptions()


def grad_norm(sumsq: float, found_inf: bool) -> float:
    """The global L2 norm of a gradient from its sum of squares (infinite where any element was not finite)."""
    return math.inf if found_inf else math.sqrt(sumsq)


@dataclasses.dataclass(frozen=True)
class Push:
    """One worker's push of one block: which block and round, the payload's encoding, the fencing, and the
    round's options."""

    block_id: str
    worker: int
    round: int
    dtype: str                      # the payload's element type (float32, float16, bfloat16)
    numel: int                      # the block's elements
    nnz: int = -1                   # a sparse (top-k) payload's entries; -1: dense
    generation: int = 0             # the job generation the worker pushes in
    fence: int = 0                  # its slot flag's fencing token (0: no flag)
    lane: int = 0                   # the flag's lane
    options: RoundOptions = NO_OPTIONS
    no_grad: tuple[int, ...] = ()   # the block's pieces this worker gave no gradient since its last sync

    @property
    def what(self) -> str:
        return f"push of block {self.block_id} by worker {self.worker} for round {self.round}"
