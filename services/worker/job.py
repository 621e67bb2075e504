"""The built-in training job that ``imerge worker`` and ``imerge launch`` run."""
from __future__ import annotations

import itertools
import logging
import time

import torch
from safetensors.torch import save_file

from imerge.core.devices import resolve_device
from imerge.core.errors import EXIT_REJOIN, IMergeError, Rejoin
from imerge.telemetry import progress
from imerge.workloads.data import make_dataset, worker_loader
from imerge.workloads.job import JobConfig, accuracy
from imerge.workloads.models import build_model

from .api import DistributedModel, distribute, load, save
from .config import WorkerConfig

log = logging.getLogger(__name__)


def _train(model: DistributedModel, train: torch.utils.data.TensorDataset, worker: WorkerConfig, job: JobConfig,
           per_epoch: int, total: int, device: torch.device) -> tuple[int, float]:
    """Iterations from the model's data position up to ``total``; returns (iterations, last loss)."""
    iteration, loss_value = model.start_iteration, float("nan")
    epoch, skip = divmod(iteration, per_epoch)
    while iteration < total:
        for x, y in itertools.islice(worker_loader(train, job.batch_size, worker.rank, worker.world_size,
                                                   job.seed, epoch), skip, None):
            tick = time.monotonic()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            iteration, loss_value = iteration + 1, loss.detach().item()
            model.engine.metrics.loss.set(loss_value)  # the job reports its own progress, with the epoch
            progress.report(iteration=iteration, total=total, loss=loss_value, epoch=epoch,
                            seconds=time.monotonic() - tick)
            if job.state_file and job.state_every and iteration % job.state_every == 0 and iteration < total:
                save(model, job.state_file)
            if iteration >= total:
                break
        epoch, skip = epoch + 1, 0
    return iteration, loss_value


def run_job(worker: WorkerConfig, job: JobConfig) -> dict[str, float]:
    """Train the built-in model; return (and report) a summary."""
    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)
    device = resolve_device(job.device, worker.local_rank, worker.rank)
    train = make_dataset(job.data, job.model, "train", job.seed, job.samples)
    model = distribute(build_model(job.model, job.seed).to(device), job.optimizer_spec(), worker)
    log.info("worker %d (local rank %d) trains %s on %s", worker.rank, worker.local_rank, job.model, device)
    per_epoch = len(worker_loader(train, job.batch_size, worker.rank, worker.world_size, job.seed))
    if per_epoch == 0:
        raise ValueError(f"--batch-size {job.batch_size} leaves no full batch for {worker.world_size} workers")
    total = job.iters or per_epoch * job.epochs
    started = time.monotonic()
    with model:
        try:
            resume = job.resume_file()
            if resume is not None and not model.rejoined:
                info = load(model, resume)
                log.info("resumed from %s at iteration %d", resume, info["iteration"])
            iteration, loss_value = _train(model, train, worker, job, per_epoch, total, device)
            if job.state_file:
                save(model, job.state_file)
            model.synchronize()
        except IMergeError as exc:  # recoverable: a peer failed or the job recovered; else fatal: end the job
            if not model.failure_reported:
                model.report_failure(f"{type(exc).__name__}: {exc}", fatal=not exc.recoverable)
            if not exc.recoverable or isinstance(exc, Rejoin):
                raise
            raise Rejoin(f"worker {worker.rank}: {exc}; exiting with code {EXIT_REJOIN} to rejoin the job "
                         f"from its last checkpoint") from exc
        summary = {"iterations": iteration, "loss": loss_value, "seconds": time.monotonic() - started}
        if job.evaluate and worker.rank == 0:
            summary["test_accuracy"] = accuracy(model.module, make_dataset(job.data, job.model, "test", job.seed,
                                                                           job.samples))
        if job.save and worker.rank == 0:
            save_file({name: p.detach().cpu().contiguous() for name, p in model.module.state_dict().items()},
                      job.save)
            log.info("model saved to %s", job.save)
    progress.report("summary", **summary)
    return summary
