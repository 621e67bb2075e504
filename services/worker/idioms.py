"""What a DDP training loop calls on its model, done the PS way: ``no_sync``, ``clip_grad_norm_``, a grad scaler.

Each of these sets a field of the loop's :class:`~.iteration.LoopSettings`
(which the next backward freezes into its round), or reads the shards' answer
for the latest round. A call that cannot mean what it means under DDP raises,
naming why.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from imerge.core.errors import UnsupportedUse
from imerge.telemetry import progress

from . import clipping, exiting
from .amp import refuse_scaling
from .config import WorkerConfig
from .engine import SyncEngine
from .iteration import LoopSettings


class DDPIdioms(torch.nn.Module):
    """DDP's calls on a wrapped model; the subclass provides the module, its config, settings and engine."""

    module: torch.nn.Module
    config: WorkerConfig
    _settings: LoopSettings
    _engine: SyncEngine | None
    _logged: tuple[float, int] | None  # (when, iteration) of the last loss reported to a launcher

    @property
    def engine(self) -> SyncEngine:
        raise NotImplementedError

    @exiting.reaching_the_script
    def grad_scaler(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> torch.amp.GradScaler:
        """A torch.amp.GradScaler on the model's device (same arguments and API): its loss scale travels with the
        pushes, the shards unscale, and skip the step on every shard when any found an inf or NaN (:mod:`.amp`;
        torch's own GradScaler, made by the script, does the same). Refuses at once what the job's options rule
        out."""
        if enabled:
            refuse_scaling(self.config.compression, self.config.interleave_period, "grad_scaler()")
        device = next(self.module.parameters()).device.type
        return torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    @exiting.reaching_the_script
    def log_loss(self, loss: torch.Tensor | float, total: int | None = None) -> None:
        """Show ``loss`` on this worker's metrics (``imerge_worker_loss``, the workers dashboard) and, under
        ``imerge launch``, worker 0's on the launcher's progress bar and in its summary, at the iterations done
        (``total``: the iterations the script will run, for the bar). A tensor is read with ``.item()``, which
        waits for the GPU: call it every few iterations where that matters."""
        value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        self.engine.metrics.loss.set(value)
        if progress.connected():
            now, iteration = time.monotonic(), self.engine.iteration
            figures: dict[str, float | int] = {"iteration": iteration, "loss": value}
            if total:
                figures["total"] = total
            if self._logged is not None and iteration > self._logged[1]:
                figures["seconds"] = (now - self._logged[0]) / (iteration - self._logged[1])
            progress.report("iteration", **figures)
            self._logged = (now, iteration)

    @exiting.reaching_the_script
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every round's averaged gradient, on the shards, to ``max_norm`` (global L2 norm over all the
        parameters), exactly as torch.nn.utils.clip_grad_norm_ would before optimizer.step().

        Called before the first backward, every round is clipped from the first one; called after a backward (as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` is, which does the same), that round and
        every later one (:mod:`.clipping`). Returns the total norm of the latest round pushed (waiting for the
        shards to agree on it), or 0 before the first one.
        """
        self._refuse_with_interleave("clip_grad_norm_()")
        max_norm = clipping.check_norm_arguments(max_norm, norm_type)
        if self._engine is None:  # before the job is joined: the engine made then takes the setting
            clipping.in_advance(self._settings, max_norm)
            return torch.tensor(0.0)
        return torch.tensor(self._engine.clip_norm(max_norm, after_backward=False))

    def _refuse_with_interleave(self, what: str) -> None:
        if self.config.interleave_period > 1:
            raise UnsupportedUse(f"{what} with --interleave-period > 1: groups sync in different iterations, so "
                                 "no round holds the whole gradient")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: the backward of every forward run inside only sums its gradients locally; the first backward
        of a forward outside pushes the sum (one optimizer step for all the micro-batches)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: False makes the backward of each forward run from now on only sum its gradients
        locally (``no_sync()`` sets it for its block); the first backward of a forward run with it True pushes
        the sum, one optimizer step for all the micro-batches."""
        return not self._settings.accumulating

    @require_backward_grad_sync.setter
    @exiting.reaching_the_script
    def require_backward_grad_sync(self, value: bool) -> None:
        if not value and self.config.interleave_period > 1:
            raise UnsupportedUse("no_sync() (or require_backward_grad_sync = False) with --interleave-period > 1: "
                                 "between syncs each backward already takes a local step; accumulate with T = 1")
        self._settings.accumulating = not value
