"""Built-in data: synthetic tensors, and the handwritten digits that scikit-learn ships.

Each worker reads a disjoint shard of the training set
(:class:`torch.utils.data.DistributedSampler` semantics); nothing is
downloaded at run time.
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from imerge.workloads.models import INPUT_SHAPES

DATASETS = ("synthetic", "digits")


def digits(split: str, seed: int = 0) -> TensorDataset:
    """scikit-learn's 1797 8x8 digits scaled to [0, 1]; a fixed 80/20 train/test split."""
    pixels, targets = _digits_table()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(targets, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    chosen = order[:cut] if split == "train" else order[cut:]
    return TensorDataset(images[chosen], labels[chosen])


@functools.lru_cache(maxsize=1)
def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (1797 x 64) and labels, read from the file scikit-learn ships (``digits.csv.gz``)
    with the parser its ``load_digits`` uses, the same values, without importing scikit-learn (1.4 s of CPU in
    every worker that trains on them). Where that file is not where scikit-learn 1.x keeps it, ``load_digits``
    reads it."""
    spec = importlib.util.find_spec("sklearn")
    package = Path(spec.origin).parent if spec is not None and spec.origin else None
    path = package / "datasets" / "data" / "digits.csv.gz" if package is not None else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        raw = load_digits()
        return raw.data, raw.target
    with gzip.open(path, mode="rt", encoding="utf-8") as text:
        table = np.loadtxt(text, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def synthetic(shape: tuple[int, ...], samples: int, seed: int = 0, split: str = "train",
              classes: int = 10) -> TensorDataset:
    """Random inputs whose labels come from a fixed random projection, so the loss can fall."""
    projection = torch.randn(math.prod(shape), classes, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    inputs = torch.randn(samples, *shape, generator=generator)
    labels = (inputs.flatten(1) @ projection).argmax(1)
    return TensorDataset(inputs, labels)


def make_dataset(name: str, model: str, split: str, seed: int = 0, samples: int = 512) -> TensorDataset:
    if name == "digits":
        if INPUT_SHAPES[model] != (1, 8, 8):
            raise ValueError(f"--data digits needs --model digits-cnn (8x8 inputs), not {model}")
        return digits(split, seed)
    if name == "synthetic":
        return synthetic(INPUT_SHAPES[model], samples if split == "train" else max(samples // 4, 1), seed, split)
    raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")


def worker_loader(dataset: TensorDataset, batch_size: int, rank: int, world_size: int, seed: int,
                  epoch: int = 0) -> DataLoader[tuple[torch.Tensor, ...]]:
    """This worker's disjoint shard of ``dataset``, reshuffled per epoch."""
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
