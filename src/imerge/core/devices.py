"""Where a worker trains: ``--device auto|cpu|cuda`` and the GPU its local rank picks."""
from __future__ import annotations

import torch

from imerge.core.config import flag_name
from imerge.core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
NO_GPU = ("cuda was asked for, but torch sees no GPU (torch.cuda.is_available() is False: no device, no driver, "
          "or a CPU build of torch)")


def check_device(requested: str) -> None:
    """ConfigError at once for ``cuda`` on a machine without a usable GPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(flag_name("device"), NO_GPU)


def resolve_device(requested: str, local_rank: int, rank: int) -> torch.device:
    """The device to train on: the GPU of ``local_rank`` (-1: ``rank`` modulo the visible GPUs) for ``cuda``, or
    for ``auto`` where a GPU is present; else the CPU. Makes that GPU the current one."""
    check_device(requested)
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = local_rank if local_rank >= 0 else rank % count
    if index >= count:
        raise ConfigError(flag_name("local_rank"), f"{index}, but this node has {count} visible GPUs")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
