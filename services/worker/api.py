"""The public API: ``imerge.distribute(model)`` wraps a module for PS training.

    model = imerge.distribute(Net(), imerge.OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()          # gradients stream to the shards during backward
    model.close()                # waits for the last sync, leaves the job

There is no local optimizer step: the optimizer runs on the shards, and the
next forward waits, module by module, for the parameters it needs.

A worker that starts while its job is already running rejoins it: if the job
has not recovered since this rank last joined, it reports its own restart (the
coordinator then starts a new generation); it waits until every shard restored
the generation's checkpoint, fetches the parameters and resumes at that
checkpoint's round (``start_iteration``: the data position to continue from).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from imerge.control.messages import FailureReport, LayoutSubmission, WorkerInfo, WorkerPosition
from imerge.control.store import Store
from imerge.core.errors import EXIT_FATAL, EXIT_REJOIN, IMergeError, InvalidArgument, StoreError, UnsupportedUse
from imerge.core.optim import OptimizerSpec
from imerge.core.planning import Plan
from imerge.telemetry import progress
from imerge.telemetry.metrics import MetricsServer

from .adoption import OptimizerWatch, optimizer_state
from .config import WorkerConfig, torchrun_identity
from .engine import JOIN_STATE, SyncEngine
from . import guards
from .amp import ShardGradScaler
from .lease import RankLease
from .joining import Heartbeat, latest_plan, rejoin_point, wait_plan
from .optimizer import ShardOptimizer, check_launch_flags, shard_optimizer
from .saving import load_model, save_model

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingSettings:
    """What the loop set before the job was joined, for the hooks made then."""

    max_norm: float = 0.0
    accumulating: bool = False

    def apply(self, hooks: Any) -> None:
        hooks.max_norm, hooks.accumulating = self.max_norm, self.accumulating


class DistributedModel(torch.nn.Module):
    """A module whose parameters are trained by the PS shards of an IMerge job.

    The job is joined (the layout sent, the plan read, the blocks made, worker 0's parameters, frozen parameters
    and buffers given to every worker) at once when ``optimizer`` is given, else at the first forward or the first
    call that needs the shards, so that an optimizer the script builds after ``imerge.distribute`` is the one the
    shards run (:mod:`.adoption`).
    """

    def __init__(self, module: torch.nn.Module, config: WorkerConfig,
                 optimizer: OptimizerSpec | torch.optim.Optimizer | None):
        super().__init__()
        self.module = module
        self.config = config
        self._watch = OptimizerWatch(module, optimizer)
        self._optimizer: ShardOptimizer | None = None
        self._store = Store(config.redis_url, config.job)
        self._lease = RankLease(self._store, config.job, config.rank, config.heartbeat_ttl_s)
        try:
            self._store.check_job(config.job_token, f"worker {config.rank}")
            self._lease.claim()
        except BaseException:
            self._store.close()
            self._watch.stop()
            raise
        self._store.register_worker(config.rank, WorkerInfo(socket.gethostname(), os.getpid()),
                                    config.heartbeat_ttl_s)
        self._heartbeat = Heartbeat(self._store, self._lease)
        self._engine: SyncEngine | None = None
        self._metrics: MetricsServer | None = None
        self._joining: Any = module.register_forward_pre_hook(self._join_at_forward, prepend=True)
        self._pending = PendingSettings()
        self._closed = False
        self._done = False  # this worker marked itself done (close): it leaves the job for good
        self._logged: tuple[float, int] | None = None  # (when, iteration) of the last loss reported to a launcher
        self.generation = 0
        self.failure_reported = False  # this worker reported a failure to the coordinator
        self.start_iteration = 0  # iterations already done when this worker (re)joined: its data position
        self.rejoined = False  # this worker joined a job that was running (after a restart)
        self._plan: Plan | None = None
        try:
            self.rejoined = self._store.job_running()
            if self.rejoined:
                self._plan = latest_plan(self._store, config)
                self.generation, self.start_iteration = rejoin_point(self._store, config,
                                                                     len(self._plan.shard_addresses))
            if optimizer is not None:
                self._join()
        except BaseException:
            self.abort()
            raise

    # -- joining the job -------------------------------------------------------------------
    def _join_at_forward(self, _module: torch.nn.Module, args: tuple) -> None:
        """The inner module's first forward (called directly, not through this wrapper) joins the job; the hooks
        the join installs run from the next forward on, so this one runs their forward start itself."""
        if self._engine is None:
            self._join()
            self._engine.hooks.first_forward(args)

    def _join(self) -> None:
        """Join the job; a join that fails leaves it (abort): what it built is of no use half made."""
        try:
            self._join_job()
        except BaseException:
            self.abort()
            raise

    def _join_job(self) -> None:
        config = self.config
        self._joining.remove()
        chosen = self._watch.choose()
        if chosen is None:
            chosen = check_launch_flags(None, config)
            log.warning("worker %d: no optimizer was given to imerge.distribute or built over the model before its "
                        "first forward: the shards run %s (OptimizerSpec.from_env(): imerge launch --optimizer, "
                        "--lr and --optimizer-args set it)", config.rank, chosen)
        else:
            chosen = check_launch_flags(chosen, config)
        layout, self._optimizer = shard_optimizer(self.module, chosen)
        if self.rejoined:
            plan = self._plan
        else:
            self._store.submit_layout(config.rank, LayoutSubmission(layout, config.plan_options()))
            plan = wait_plan(self._store, config)
            self.generation = self._store.generation() or 0
        self._engine = SyncEngine(self.module, [p.name for p in layout.params], plan, config, self._optimizer,
                                  self._store, self.generation)
        guards.guard(self._engine.params)
        self._metrics = MetricsServer(self._engine.metrics.registry, config.metrics_port, f"worker {config.rank}",
                                      config.metrics_address(), ports_file=config.ports_file)
        if self.rejoined:
            self._engine.resume(self.start_iteration)
            if isinstance(chosen, torch.optim.Optimizer) and chosen.state:
                log.info("worker %d: rejoined: the optimizer state the script loaded is ignored, the shards restored "
                         "their own checkpoint", config.rank)
        else:
            self._engine.initialize(self._loaded_state(chosen))
        self._engine.share_module_state(JOIN_STATE)
        self._pending.apply(self._engine.hooks)
        self._store.record_worker(config.rank, WorkerPosition(self.start_iteration, self.generation))
        engine = self._engine
        self._heartbeat.position = lambda: (self.generation, engine.iteration)
        self._store.heartbeat(config.rank, config.heartbeat_ttl_s, self.generation)
        log.info("worker %d/%d %s job %s in generation %d at iteration %d: %d groups on %d shards", config.rank,
                 config.world_size, "rejoined" if self.rejoined else "joined", config.job, self.generation,
                 self.start_iteration, len(plan.groups), len(plan.shard_addresses))

    def _loaded_state(self, chosen: Any) -> dict[str, dict[str, torch.Tensor]]:
        """The state of the script's own optimizer (a checkpoint's, loaded before the job started): worker 0's goes
        to the shards with the blocks, and the optimizer keeps none of it here (it lives on the shards)."""
        if not isinstance(chosen, torch.optim.Optimizer) or not chosen.state:
            return {}
        state = optimizer_state(chosen, self._engine.hooks.names)  # a frozen parameter's is never used
        chosen.state.clear()
        return state if self.config.rank == 0 else {}

    @property
    def engine(self) -> SyncEngine:
        if self._engine is None:
            if self._closed:
                raise IMergeError("this DistributedModel is closed")
            with self._reporting():
                self._join()
        return self._engine

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    @property
    def optimizer(self) -> ShardOptimizer:
        """The shards' optimizer as the loop sees it: a torch.optim.Optimizer whose param_groups each round's
        pushes carry (attach any torch.optim.lr_scheduler to it); step() and zero_grad() have nothing to do.
        Reading it joins the job (with the optimizer built so far, or the default)."""
        self.engine
        return self._optimizer

    @property
    def metrics_port(self) -> int:
        """The port of this worker's /metrics (-1: off)."""
        return self._metrics.port if self._metrics is not None else -1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine  # fail loudly once closed
        self._lease.check()
        with self._reporting():
            return self.module(*args, **kwargs)

    def grad_scaler(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> ShardGradScaler:
        """A torch.amp.GradScaler (same arguments and API) whose loss scale travels with the pushes: the shards
        unscale, and skip the step on every shard when any found an inf or NaN."""
        self._refuse_with_interleave("grad_scaler()")
        if enabled and self.config.compression in ("topk", "mixed"):
            raise UnsupportedUse(f"grad_scaler() with --compression {self.config.compression}: the top-k residual "
                                 "would keep gradients of an old loss scale, and an overflow would stay in it for "
                                 "good; use --compression fp16 or bf16 (or none) with a grad scaler")
        device = next(self.module.parameters()).device.type
        return ShardGradScaler(lambda: self.engine.hooks, device, init_scale, growth_factor, backoff_factor,
                               growth_interval, enabled)

    def log_loss(self, loss: torch.Tensor | float, total: int | None = None) -> None:
        """Show ``loss`` on this worker's metrics (``imerge_worker_loss``, the workers dashboard) and, under
        ``imerge launch``, worker 0's on the launcher's progress bar and in its summary, at the iterations done
        (``total``: the iterations the script will run, for the bar). A tensor is read with ``.item()``, which
        waits for the GPU: call it every few iterations where that matters."""
        value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        self.engine.metrics.loss.set(value)
        if progress.connected():
            now, iteration = time.monotonic(), self.engine.iteration
            figures = {"seconds": (now - self._logged[0]) / max(1, iteration - self._logged[1])} \
                if self._logged is not None and iteration > self._logged[1] else {}
            progress.report(iteration=iteration, loss=value, **({"total": total} if total else {}), **figures)
            self._logged = (now, iteration)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every round's averaged gradient, on the shards, to ``max_norm`` (global L2 norm over all the
        parameters), exactly as torch.nn.utils.clip_grad_norm_ would before optimizer.step().

        The gradients leave during backward, so the value must be set before the first backward (calling it
        again after each backward, where DDP loops do, keeps it). Returns the total norm of the latest round
        pushed (waiting for the shards to agree on it), or 0 before the first one.
        """
        self._refuse_with_interleave("clip_grad_norm_()")
        if float(norm_type) != 2.0:
            raise UnsupportedUse(f"clip_grad_norm_ with norm_type {norm_type}: the shards clip by the L2 norm only")
        if not max_norm > 0:
            raise InvalidArgument(f"clip_grad_norm_: max_norm must be positive, got {max_norm}")
        if self._engine is None:  # before the job is joined: kept for it
            self._pending.max_norm = float(max_norm)
            return torch.tensor(0.0)
        hooks = self._engine.hooks
        if hooks.max_norm == 0 and hooks.started:
            raise UnsupportedUse("clip_grad_norm_() after the first backward: that round was pushed, and applied, "
                                 "without clipping; call it once before the first backward (the value stays)")
        hooks.max_norm = float(max_norm)
        result = hooks.last_round_result()
        return torch.tensor(result.grad_norm if result is not None else 0.0)

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
        return not (self._engine.hooks.accumulating if self._engine is not None else self._pending.accumulating)

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not value and self.config.interleave_period > 1:
            raise UnsupportedUse("no_sync() (or require_backward_grad_sync = False) with --interleave-period > 1: "
                                 "between syncs each backward already takes a local step; accumulate with T = 1")
        if self._engine is None:
            self._pending.accumulating = not value
        else:
            self._engine.hooks.accumulating = not value

    def synchronize(self) -> None:
        """Wait for every in-flight sync, so the parameters are the shards' latest."""
        with self._reporting():
            self.engine.synchronize()

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """A sync that failed is reported to the coordinator once, before the error reaches the caller: a
        recoverable one starts a recovery, a fatal one (``recoverable`` False) ends the job with its message."""
        try:
            yield
        except IMergeError as exc:
            if not self.failure_reported:
                self.report_failure(f"{type(exc).__name__}: {exc}", fatal=not exc.recoverable)
            raise

    def report_failure(self, reason: str, fatal: bool = False) -> None:
        """Tell the coordinator this worker saw the job fail in its generation: it starts a recovery, or, for a
        ``fatal`` error that a recovery would only repeat, ends the job with ``reason``."""
        self.failure_reported = True
        try:
            self._store.report_failure(FailureReport(self.generation, f"worker {self.config.rank}", reason, fatal))
        except StoreError as exc:
            log.warning("could not report the failure to the coordinator: %s", exc)

    def abort(self) -> None:
        """Leave at once: no final sync, no done mark (the others will time out naming this worker)."""
        self._closed = True
        self._joining.remove()
        self._watch.stop()
        if self._engine is not None:
            guards.release(self._engine.params)
            self._engine.close()
            self._engine = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._heartbeat.stop()
        try:
            self._lease.release()
            if self._done:  # gone for good: the coordinator trusts the done mark once the worker has left
                self._store.leave(self.config.rank)
        except StoreError as exc:
            log.warning("could not release rank %d's lease (it expires by itself): %s", self.config.rank, exc)
        self._store.close()

    def close(self) -> None:
        """Finish the last sync, tell the coordinator this worker is done, release resources (a worker that has not
        joined the job yet joins it first: the others wait for it)."""
        if self._closed:
            return
        try:
            self.engine
            with self._reporting():
                self._engine.hooks.flush()
                self._engine.synchronize()
                self._engine.hooks.buffer_sync.apply()  # every worker ends with the same buffers
            self._store.mark_done(self.config.rank)
            self._done = True
        finally:
            self.abort()

    def __enter__(self) -> "DistributedModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


_live: "weakref.WeakSet[DistributedModel]" = weakref.WeakSet()  # every model not closed yet, for the exit hook
_uncaught: list[BaseException] = []  # the exception ending the script, if one does


def _exit_code(error: BaseException) -> int:
    if isinstance(error, IMergeError):
        return EXIT_REJOIN if error.recoverable else EXIT_FATAL
    return 1


def _leave_at_exit() -> None:
    """At interpreter exit, every model the script did not close leaves the job: with the last sync and a done mark
    where the script ended normally (a DDP script has no close() to call), at once where an exception ended it.
    The comm thread is stopped here, before the interpreter tears down under it."""
    for model in list(_live):
        if model._closed:
            continue
        if _uncaught:
            model.abort()
            continue
        try:
            model.close()
        except BaseException as exc:  # noqa: BLE001 - the process must say it failed, not exit 0
            log.error("worker %d could not leave the job at exit: %s: %s", model.config.rank, type(exc).__name__, exc)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_exit_code(exc))


def _exit_codes(previous: Callable[..., Any]) -> Callable[..., Any]:
    """An excepthook that ends a training script killed by an IMerge error with the code its supervisor reads:
    EXIT_REJOIN (recoverable: restart it and it rejoins) or EXIT_FATAL (restarting would fail the same way); any
    uncaught exception makes the exit hook abort (not close) the models still open."""

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        _uncaught.append(value)
        previous(kind, value, traceback)
        if isinstance(value, IMergeError):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_exit_code(value))

    hook.imerge = True  # type: ignore[attr-defined]
    return hook


def distribute(module: torch.nn.Module, optimizer: OptimizerSpec | torch.optim.Optimizer | None = None,
               config: WorkerConfig | None = None, **options: Any) -> DistributedModel:
    """Join the IMerge job described by ``config`` (default: ``IMERGE_*`` variables plus ``options``).

    ``optimizer`` runs on the shards: an ``imerge.OptimizerSpec`` (any torch.optim optimizer by name, with its
    keyword arguments), or a torch.optim optimizer built over the model's parameters (its class, arguments and
    parameter groups are used; the default is ``OptimizerSpec.from_env()``, plain SGD at lr 0.01 unless
    ``imerge launch`` was given optimizer flags). Rank 0's optimizer and initial parameters are the ones the
    shards keep. Under ``imerge launch``, a flag given to the launcher that the script overrides raises
    ConfigError naming it: launch flags are never silently ignored.
    """
    from imerge.core.config import from_env

    if not getattr(sys.excepthook, "imerge", False):
        sys.excepthook = _exit_codes(sys.excepthook)
        atexit.register(_leave_at_exit)
    if config is None:
        config = from_env(WorkerConfig, **{**torchrun_identity(os.environ), **options})
    elif options:
        raise IMergeError("pass either a WorkerConfig or keyword options, not both")
    if optimizer is not None:
        optimizer = check_launch_flags(optimizer, config)
    model = DistributedModel(module, config, optimizer)
    _live.add(model)
    return model


def save(model: DistributedModel, path: str | os.PathLike) -> None:
    """Save the model (parameters and buffers) and the shards' optimizer state to ``path`` (safetensors).

    Every worker calls it at the same point of its loop; worker 0 writes the file. An LR scheduler's or a grad
    scaler's state is the script's: save their ``state_dict()`` as with DDP.
    """
    with model._reporting():
        save_model(model, path, model.engine.iteration)


def load(model: DistributedModel, path: str | os.PathLike) -> dict[str, Any]:
    """Load a file of :func:`save` into the job: worker 0 reads it (only it needs the file) and the shards take its
    parameters and optimizer state; every worker calls it at the same point (before training, or between two
    iterations). Returns the file's metadata, with ``iteration`` (the iterations done when it was saved: the
    data position to continue from), also kept as ``model.start_iteration``."""
    with model._reporting():
        metadata = load_model(model, path)
    model.start_iteration = int(metadata.get("iteration", 0))
    return {**metadata, "iteration": model.start_iteration}
