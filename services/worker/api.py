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

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import torch

from imerge.control.messages import FailureReport, Member, LayoutSubmission, WorkerInfo, WorkerPosition
from imerge.control.store import WorkerStore
from imerge.core.errors import IMergeError, StoreError, UnsupportedUse
from imerge.core.memory import keep_freed_memory
from imerge.core.optim import OptimizerSpec
from imerge.core.planning import Plan
from imerge.telemetry.metrics import MetricsServer

from .adoption import OptimizerWatch, take_loaded_state
from .config import ScheduleConfig, WorkerConfig, torchrun_identity
from .engine import JOIN_STATE, SyncEngine
from .iteration import LoopSettings
from . import exiting, guards, torch_patches
from .idioms import DDPIdioms
from .lease import RankLease
from .joining import Heartbeat, latest_plan, rejoin_point, wait_plan
from .optimizer import ShardOptimizer, check_launch_flags, shard_optimizer
from .saving import load, save

__all__ = ["DistributedModel", "distribute", "save", "load"]
log = logging.getLogger(__name__)


class DistributedModel(DDPIdioms):
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
        keep_freed_memory()  # an iteration's large tensors come back every iteration: their pages stay
        torch_patches.install()  # torch's clipping, optimizers, GradScaler and the exit hooks, the PS way
        self._watch = OptimizerWatch(module, optimizer)
        self._optimizer: ShardOptimizer | None = None
        self._store = WorkerStore(config.redis_url, config.job)
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
        self._settings = LoopSettings()  # the loop's settings, before and after the job is joined
        self._closed = False
        self._disowned = False  # this process was forked from the model's: it is not the model's process
        self._done = False  # this worker marked itself done (close): it leaves the job for good
        self._logged: tuple[float, int] | None = None  # (when, iteration) of the last loss reported to a launcher
        self.generation = 0
        self.failure_reported = False  # this worker reported a failure to the coordinator
        self.fatal: IMergeError | None = None  # the fatal error that reached the script: the job failed with it
        self.training_thread = threading.get_ident()  # the thread that trains the model (made it)
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
    def _join_at_forward(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """The inner module's first forward (called directly, not through this wrapper) joins the job; the hooks
        the join installs run from the next forward on, so this one runs their forward start itself."""
        if self._engine is None:
            self._join()
            self.engine.first_forward(args)

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
        if self.rejoined and self._plan is not None:
            plan = self._plan
        else:
            self._store.submit_layout(config.rank, LayoutSubmission(layout, config.plan_options(), config))
            plan = wait_plan(self._store, config)
            self.generation = self._store.generation() or 0
        self._engine = SyncEngine(self.module, [p.name for p in layout.params], plan, config, self._optimizer,
                                  self._store, self.generation, self._settings)
        guards.guard(self._engine)
        self._metrics = MetricsServer(self._engine.metrics.registry, config.metrics_port, f"worker {config.rank}",
                                      config.metrics_address(), ports_file=config.ports_file)
        if self.rejoined:
            self._engine.resume(self.start_iteration)
            if isinstance(chosen, torch.optim.Optimizer) and chosen.state:
                log.info("worker %d: rejoined: the optimizer state the script loaded is ignored, the shards restored "
                         "their own checkpoint", config.rank)
        else:
            self._engine.initialize(take_loaded_state(chosen, self._engine.names, config.rank))
        self._engine.share_module_state(JOIN_STATE)
        self._store.record_worker(config.rank, WorkerPosition(self.start_iteration, self.generation))
        engine = self._engine
        self._heartbeat.position = lambda: (self.generation, engine.iteration)
        self._store.heartbeat(config.rank, config.heartbeat_ttl_s, self.generation)
        log.info("worker %d/%d %s job %s in generation %d at iteration %d: %d groups on %d shards", config.rank,
                 config.world_size, "rejoined" if self.rejoined else "joined", config.job, self.generation,
                 self.start_iteration, len(plan.groups), len(plan.shard_addresses))

    @property
    def loop_settings(self) -> LoopSettings:
        """What the script set for its coming backward passes (a grad scaler's scale, clipping, no_sync)."""
        return self._settings

    def _disown(self) -> None:
        """In a process forked from the model's (a DataLoader worker, multiprocessing, os.fork): the module
        becomes a plain local module again (its hooks and guards removed, in this process's memory only), and
        the model refuses any use; nothing here touches the job (no connection, no lease, no done mark)."""
        self._disowned = self._closed = True
        self._joining.remove()
        if self._engine is not None:
            self._engine.disown()
            guards.release(self._engine)

    def _refuse_in_child(self, what: str) -> None:
        if self._disowned:
            raise UnsupportedUse(f"{what} in a process forked from the training script's (a DataLoader worker, "
                                 f"multiprocessing, os.fork): the model belongs to worker {self.config.rank}'s "
                                 "own process; a child may use model.module as a plain local module")

    @property
    def engine(self) -> SyncEngine:
        """The job's engine of this worker; reading it joins the job first if this model has not (see
        :meth:`joined`)."""
        return self.joined()

    def joined(self) -> SyncEngine:
        """The engine, joining the job first if this model has not yet (a model joins at its first forward, or at
        the first use that needs the job: its optimizer, a save, a close). Raises the job's fatal error if it
        failed, and IMergeError once the model is closed or in a forked child."""
        self._refuse_in_child("using an IMerge model")
        if self.fatal is not None:  # the job failed with it (the script caught it): nothing more to do here
            raise self.fatal
        if self._engine is None:
            if self._closed:
                raise IMergeError("this DistributedModel is closed")
            with self._reporting():
                self._join()
        if self._engine is None:  # a join that fails raises; one that returns made the engine
            raise IMergeError("this DistributedModel has no engine: its join did not complete")
        return self._engine

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    @property
    def optimizer(self) -> ShardOptimizer:
        """The shards' optimizer as the loop sees it: a torch.optim.Optimizer whose param_groups each round's
        pushes carry (attach any torch.optim.lr_scheduler to it); step() and zero_grad() have nothing to do.
        Reading it joins the job (with the optimizer built so far, or the default)."""
        self.joined()
        if self._optimizer is None:  # made by the join, with the engine
            raise IMergeError("this DistributedModel has no optimizer: its join did not complete")
        return self._optimizer

    @property
    def metrics_port(self) -> int:
        """The port of this worker's /metrics (-1: off)."""
        return self._metrics.port if self._metrics is not None else -1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.joined()  # fail loudly once closed
        self._lease.check()
        with self._reporting():
            return self.module(*args, **kwargs)

    def synchronize(self) -> None:
        """Wait for every in-flight sync, so the parameters are the shards' latest."""
        with self._reporting():
            self.engine.synchronize()

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """An error of a sync is reported to the coordinator before it reaches the caller (:meth:`refused`)."""
        try:
            yield
        except IMergeError as exc:
            self.refused(exc)
            raise

    def refused(self, error: IMergeError) -> None:
        """``error`` reaches the script: reported to the coordinator once (a recoverable one starts a recovery, a
        fatal one ends the job with its message); a fatal one is kept, so that whatever the script does with it,
        this worker never marks itself done (close() raises it again, the exit hook ends with EXIT_FATAL)."""
        if self._disowned:
            return
        if not error.recoverable and self.fatal is None:
            self.fatal = error
        if not self.failure_reported:
            self.report_failure(f"{type(error).__name__}: {error}", fatal=not error.recoverable)

    def report_failure(self, reason: str, fatal: bool = False) -> None:
        """Tell the coordinator this worker saw the job fail in its generation: it starts a recovery, or, for a
        ``fatal`` error that a recovery would only repeat, ends the job with ``reason``."""
        self.failure_reported = True
        try:
            self._store.report_failure(FailureReport(self.generation, str(Member.worker(self.config.rank)), reason, fatal))
        except StoreError as exc:
            log.warning("could not report the failure to the coordinator: %s", exc)

    def abort(self) -> None:
        """Leave at once: no final sync, no done mark (the others will time out naming this worker). In a
        forked child, nothing: the job is the parent's."""
        if self._disowned:
            return
        self._closed = True
        self._joining.remove()
        self._watch.stop()
        if self._engine is not None:
            guards.release(self._engine)
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
        self._refuse_in_child("model.close()")
        if self._closed:
            return
        if self.fatal is not None:  # the job failed with it: leave at once, never with a done mark
            self.abort()
            raise self.fatal
        try:
            engine = self.joined()
            with self._reporting():
                engine.finish()  # every worker ends with the same parameters and buffers
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
    from imerge.core.config import explicit_fields, from_env

    if config is None:  # --tune auto: the knobs neither a keyword nor an IMERGE_* variable gives
        config = from_env(WorkerConfig, **{**torchrun_identity(os.environ), **options})
        config = config.tuned(explicit_fields(ScheduleConfig, set(options)))
    elif options:
        raise IMergeError("pass either a WorkerConfig or keyword options, not both")
    if optimizer is not None:
        optimizer = check_launch_flags(optimizer, config)
    model = DistributedModel(module, config, optimizer)
    exiting.track(model)
    return model
