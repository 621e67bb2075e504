"""A DDP-style loop over epochs of a DataLoader with worker processes, run by tests/test_child_processes.py under
`imerge launch`: the only IMerge line is the wrap.

Rank 0 writes --out (JSON): each epoch's wall time, the done marks the job's Redis held at each epoch's end, and
the final parameters. --crash-at K kills rank 1 with SIGKILL at iteration K of its first run (a marker file says
it ran); restarted, the script resumes at the model's start_iteration, as a restartable DDP script does.
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import imerge


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--context", choices=["fork", "spawn"], default="fork")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = imerge.distribute(model)

    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 1, 8, 8, generator=generator), torch.randint(0, 10, (96,), generator=generator))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=args.loader_workers,
                        persistent_workers=args.persistent,
                        multiprocessing_context=args.context if args.loader_workers else None)
    start, iteration = model.start_iteration, 0
    marker = args.out + f".crashed{rank}"
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        began = time.monotonic()
        for images, labels in loader:
            if iteration < start:  # a restarted worker resumes where the recovered job stands
                iteration += 1
                continue
            if iteration == args.crash_at and rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            iteration += 1
        epochs.append({"seconds": time.monotonic() - began, "done": sorted(done_marks())})
    if rank == 0:
        state = {name: value.tolist() for name, value in model.module.state_dict().items()}
        with open(args.out, "w") as out:
            json.dump({"epochs": epochs, "iterations": iteration, "state": state}, out)


def done_marks() -> set[int]:
    """The ranks the job's Redis holds a done mark of (what the coordinator counts as finished)."""
    from imerge.control.store import Store

    store = Store(os.environ["IMERGE_REDIS_URL"], os.environ["IMERGE_JOB"])
    try:
        return store.done_ranks()
    finally:
        store.close()


if __name__ == "__main__":
    main()
