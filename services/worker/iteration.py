"""What an iteration of the training loop is, and who decides each part of it.

* :class:`LoopSettings`: what the script sets between iterations (clipping,
  no_sync, the grad scaler's scale). It exists before the job is joined, so a
  setting made then is the engine's without a copy; only the training thread
  writes it.
* :class:`RoundContext`: one backward's round, frozen when the backward starts:
  every push of that backward carries the same hyperparameters and scaling,
  whatever the script changes meanwhile.
* :class:`~imerge.core.schedule.SyncSchedule` (pure, in the core): whether group
  g syncs in an iteration; :class:`~imerge.core.backward.BackwardPolicy`, what
  each backward does group by group (the simulator runs the same kernel).
* :class:`LoopState`: the training thread's counters, and the misuse its
  backward and ``optimizer.step()`` calls reveal.
"""
from __future__ import annotations

import dataclasses

from imerge.core.errors import UnsupportedUse
from imerge.core.rounds import RoundOptions



@dataclasses.dataclass(slots=True)
class LoopSettings:
    """What the loop set for its coming backward passes (the training thread's)."""

    max_norm: float = 0.0       # clip every round's averaged gradient to this norm (0: no clipping)
    clip_value: float = 0.0     # clamp every round's averaged gradient's elements to +-this first (0: not)
    clipping_known: bool = False  # the rounds' clipping is known: set before the first backward, or learned in it
    clips_after_backward: bool = False  # the script clips each round after its backward (torch's functions)
    accumulating: bool = False  # inside no_sync(): the backward of a forward run now only accumulates
    loss_scale: float = 0.0     # the grad scaler's scale of the coming backward (0: none; reset by each backward)


@dataclasses.dataclass(frozen=True, slots=True)
class RoundContext:
    """One backward's round: what each of its pushes says besides the data, frozen when the backward starts."""

    hypers: tuple[str, ...] = ()  # each optimizer param group's hyperparameters (JSON of what changed)
    loss_scale: float = 0.0
    max_norm: float = 0.0
    clip_value: float = 0.0

    def options(self, param_group: int, assign: bool = False) -> RoundOptions:
        """A block's round options: its param group's hyperparameters; an assignment (load_state_dict) carries
        parameters, so no scaling."""
        if assign:
            return RoundOptions(self.hypers[param_group], True)
        return RoundOptions(self.hypers[param_group], False, self.loss_scale, self.max_norm, self.clip_value)


@dataclasses.dataclass(slots=True)
class LoopState:
    """The training thread's counters of the loop."""

    rank: int
    iteration: int = 0             # backward passes completed (no_sync micro-batches excepted)
    in_backward: bool = False      # a backward started (its end-of-backward callback is queued)
    forward_seen: bool = False     # a forward that records gradients ran since the last backward ended
    accumulate: bool = False       # that forward ran inside no_sync(): its backward only accumulates
    forward_started: float = 0.0   # wall clock of the latest forward's start
    groups_enqueued: int = 0       # this iteration's groups sent
    holding: bool = False          # this round's complete groups wait for the script's clipping (.clipping)
    clipped: bool = False          # the script clipped the latest round after its backward
    clip_checked: int = 0          # the iteration whose first forward checked the clipping of the round before
    script_steps: bool = False     # the loop calls optimizer.step(): then each synced backward needs one
    backwards_since_step: int = 0
    round: RoundContext = RoundContext()  # the current (or latest) backward's

    def backward_starts(self) -> None:
        """Refuse a backward that would step the shards twice for one step of the script."""
        if not self.forward_seen and self.iteration > 0 and not self.accumulate:
            raise UnsupportedUse(
                f"worker {self.rank}: a second backward after iteration {self.iteration} without a forward "
                "of the wrapped model in between: every backward is one optimizer step on the shards, so it would "
                "step twice (or, on one rank only, desynchronize the job); run the wrapped model's forward before "
                "each backward, or accumulate gradients under model.no_sync()")
        if self.script_steps and self.backwards_since_step and not self.accumulate:
            raise UnsupportedUse(
                f"worker {self.rank}: a second backward since the last optimizer.step(): with IMerge every "
                "backward is an optimizer step on the shards, so accumulating gradients over several backward "
                "passes before one step (as DDP allows) would take a step per backward. Accumulate under "
                "model.no_sync() (or model.require_backward_grad_sync = False) for every backward but the last")
        self.in_backward = True

    def backward_ended(self, counted: bool) -> None:
        """A backward ended; ``counted``: it was an iteration (not a no_sync micro-batch)."""
        self.in_backward = self.forward_seen = False
        if counted:
            self.iteration += 1
            self.backwards_since_step += 1
            self.groups_enqueued = 0

    def stepped(self) -> None:
        """The loop called optimizer.step(): after more than one synced backward since the last, that step stands
        for several shard steps (DDP-style accumulation without no_sync)."""
        if self.backwards_since_step > 1:
            self.backwards_since_step = 0
            raise UnsupportedUse(
                f"worker {self.rank}: optimizer.step() after several backward passes: with IMerge every "
                "backward is an optimizer step on the shards, so gradients accumulated over several backward passes "
                "were stepped once each. Accumulate under model.no_sync() (or model.require_backward_grad_sync = "
                "False) for every backward but the last")
        self.script_steps = True
        self.backwards_since_step = 0

    @property
    def started(self) -> bool:
        """Whether a round was pushed (or is being pushed) already."""
        return self.iteration > 0 or self.in_backward
