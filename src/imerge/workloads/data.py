"""Built-in data: synthetic tensors, and the handwritten digits that scikit-learn ships.

Each worker reads a disjoint shard of the training set
(:class:`torch.utils.data.DistributedSampler` semantics); nothing is
downloaded at run time.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from imerge.workloads.models import INPUT_SHAPES

DATASETS = ("synthetic", "digits")


def digits(split: str, seed: int = 0) -> TensorDataset:
    """scikit-learn's 1797 8x8 digits scaled to [0, 1]; a fixed 80/20 train/test split."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    chosen = order[:cut] if split == "train" else order[cut:]
    return TensorDataset(images[chosen], labels[chosen])


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
