"""The built-in training job that ``imerge worker`` and ``imerge launch`` run."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch
from safetensors.torch import save_file

from imerge import progress
from imerge.config import option, require
from imerge.errors import EXIT_REJOIN, GenerationChanged, Rejoin, RemoteError
from imerge.data import DATASETS, make_dataset, worker_loader
from imerge.models import MODELS, build_model
from imerge.optim import OPTIMIZERS, OptimizerSpec

from .api import distribute
from .config import WorkerConfig

log = logging.getLogger(__name__)
# Failures of a peer (dead, frozen or partitioned shard or worker, a recovery under way): rejoin
RECOVERABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "ABORTED"}


def recoverable(exc: BaseException) -> bool:
    """Whether the job can go on without this process: a peer failed, a recovery began, or it was preempted."""
    return isinstance(exc, (GenerationChanged, Rejoin)) or (isinstance(exc, RemoteError)
                                                           and exc.status in RECOVERABLE)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    model: str = option("digits-cnn", "built-in model", choices=MODELS)
    data: str = option("synthetic", "built-in data set", choices=DATASETS)
    iters: int = option(0, "iterations to train (0: run --epochs epochs)")
    epochs: int = option(1, "epochs to train when --iters is 0")
    batch_size: int = option(32, "batch size per worker")
    seed: int = option(0, "seed of the model's initialization and of the data order")
    samples: int = option(512, "size of the synthetic training set")
    evaluate: bool = option(True, "measure test accuracy at the end (worker 0)")
    torch_threads: int = option(0, "torch intra-op threads per worker (0: torch's default)")
    optimizer: str = option("sgd", "optimizer run on the shards", choices=OPTIMIZERS)
    lr: float = option(0.05, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(5e-4, "weight decay")
    nesterov: bool = option(False, "SGD Nesterov momentum")
    save: str = option("", "worker 0 saves the trained parameters to this safetensors file")

    def __post_init__(self) -> None:
        require(self.iters >= 0, "iters", "must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        require(self.samples >= 1, "samples", "must be >= 1")
        require(self.torch_threads >= 0, "torch_threads", "must be >= 0")
        require(self.lr > 0, "lr", "must be positive")
        require(self.data != "digits" or self.model == "digits-cnn", "data", "digits needs --model digits-cnn")

    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(self.optimizer, lr=self.lr, momentum=self.momentum if self.optimizer == "sgd" else 0.0,
                             weight_decay=self.weight_decay, nesterov=self.nesterov)


def accuracy(model: torch.nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        inputs, labels = dataset.tensors
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in zip(inputs.split(256), labels.split(256)))
    model.train()
    return correct / len(labels)


def _train(model: torch.nn.Module, train: torch.utils.data.TensorDataset, worker: WorkerConfig, job: JobConfig,
           per_epoch: int, total: int) -> tuple[int, float]:
    """Iterations from the model's data position up to ``total``; returns (iterations, last loss)."""
    iteration, loss_value = model.start_iteration, float("nan")
    epoch, skip = divmod(iteration, per_epoch)
    while iteration < total:
        for x, y in itertools.islice(worker_loader(train, job.batch_size, worker.rank, worker.world_size,
                                                   job.seed, epoch), skip, None):
            tick = time.monotonic()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            iteration, loss_value = iteration + 1, loss.detach().item()
            progress.report(iteration=iteration, total=total, loss=loss_value, epoch=epoch,
                            seconds=time.monotonic() - tick)
            if iteration >= total:
                break
        epoch, skip = epoch + 1, 0
    return iteration, loss_value


def run_job(worker: WorkerConfig, job: JobConfig) -> dict[str, float]:
    """Train the built-in model; return (and report) a summary."""
    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)
    train = make_dataset(job.data, job.model, "train", job.seed, job.samples)
    model = distribute(build_model(job.model, job.seed), job.optimizer_spec(), worker)
    per_epoch = len(worker_loader(train, job.batch_size, worker.rank, worker.world_size, job.seed))
    if per_epoch == 0:
        raise ValueError(f"--batch-size {job.batch_size} leaves no full batch for {worker.world_size} workers")
    total = job.iters or per_epoch * job.epochs
    started = time.monotonic()
    with model:
        try:
            iteration, loss_value = _train(model, train, worker, job, per_epoch, total)
            model.synchronize()
        except Exception as exc:
            if not recoverable(exc):
                raise
            model.report_failure(str(exc))
            if isinstance(exc, Rejoin):
                raise
            raise Rejoin(f"worker {worker.rank}: {exc}; exiting with code {EXIT_REJOIN} to rejoin the job "
                         f"from its last checkpoint") from exc
        summary = {"iterations": iteration, "loss": loss_value, "seconds": time.monotonic() - started}
        if job.evaluate and worker.rank == 0:
            summary["test_accuracy"] = accuracy(model.module, make_dataset(job.data, job.model, "test", job.seed,
                                                                           job.samples))
        if job.save and worker.rank == 0:
            save_file({name: p.detach().contiguous() for name, p in model.module.state_dict().items()}, job.save)
            log.info("model saved to %s", job.save)
    progress.report("summary", **summary)
    return summary
