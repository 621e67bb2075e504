"""The built-in training job's options, shared by the IMerge worker and the DDP baseline of the benchmarks."""
from __future__ import annotations

import dataclasses
import json
from typing import Any
from pathlib import Path

import torch

from imerge.core.config import flag_name, option, require
from imerge.core.devices import DEVICES, check_device
from imerge.core.errors import ConfigError, InvalidArgument
from imerge.core.optim import OPTIMIZERS, OptimizerSpec
from imerge.workloads.data import DATASETS
from imerge.workloads.models import MODELS


STATE_FILE = "state.safetensors"  # the job's saved state in an imerge launch log folder
# The options that reach a script's OptimizerSpec.from_env() under imerge launch
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "weight_decay", "nesterov", "optimizer_args")


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
    device: str = option("auto", "where the built-in job trains: auto (the GPU of this worker's local rank when "
                                 "torch sees one, else the CPU), cpu or cuda", choices=DEVICES)
    optimizer: str = option("sgd", "optimizer run on the shards (a torch.optim class, lower case)",
                            choices=OPTIMIZERS)
    optimizer_args: str = option("", "more keyword arguments of the optimizer, as a JSON object "
                                     "(e.g. '{\"betas\": [0.9, 0.95]}')")
    lr: float = option(0.05, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(5e-4, "weight decay")
    nesterov: bool = option(False, "SGD Nesterov momentum")
    save: str = option("", "worker 0 saves the trained parameters to this safetensors file")
    state_file: str = option("", "save the job's state (model, buffers and the shards' optimizer state, with "
                                 "imerge.save) to this file at the end, and every --state-every iterations; "
                                 "imerge launch sets <log dir>/state.safetensors")
    state_every: int = option(0, "also save the job's state every this many iterations (0: only at the end)")
    resume: str = option("", "continue from a saved state: an imerge.save file, or an imerge launch log folder "
                             "holding state.safetensors (a finished or stopped run of the same job)")

    def __post_init__(self) -> None:
        require(self.iters >= 0, "iters", "must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        require(self.samples >= 1, "samples", "must be >= 1")
        require(self.torch_threads >= 0, "torch_threads", "must be >= 0")
        require(self.lr > 0, "lr", "must be positive")
        require(self.state_every >= 0, "state_every", "must be >= 0")
        require(not self.resume or Path(self.resume).exists(), "resume", f"{self.resume} does not exist")
        require(self.data != "digits" or self.model == "digits-cnn", "data", "digits needs --model digits-cnn")
        self.optimizer_spec()
        check_device(self.device)

    def resume_file(self) -> Path | None:
        """The file --resume names (a log folder's state.safetensors), or None."""
        if not self.resume:
            return None
        path = Path(self.resume)
        return path / STATE_FILE if path.is_dir() else path

    def optimizer_spec(self) -> OptimizerSpec:
        """The optimizer the options describe (momentum and nesterov are SGD's; others via --optimizer-args)."""
        options: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer == "sgd":
            options.update(momentum=self.momentum, nesterov=self.nesterov)
        try:
            options.update(json.loads(self.optimizer_args) if self.optimizer_args else {})
            return OptimizerSpec(self.optimizer, **options).validate()
        except (ValueError, TypeError, InvalidArgument) as exc:
            raise ConfigError(flag_name("optimizer_args"), str(exc)) from None


def accuracy(model: torch.nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        inputs, labels = dataset.tensors
        correct = sum(int((model(x.to(device)).argmax(1).cpu() == y).sum())
                      for x, y in zip(torch.split(inputs, 256), torch.split(labels, 256)))
    model.train()
    return correct / len(labels)
