"""A user script for `imerge launch --shards 2 --workers 2 -- python examples/train_digits.py`.

Identity (rank, world size, Redis, job) comes from the IMERGE_* variables the launcher sets.
"""
import logging
import time

import torch

import imerge
from imerge.telemetry import progress
from imerge.workloads.data import digits, worker_loader
from imerge.workloads.models import DigitsCNN

logging.basicConfig(level=logging.INFO)
torch.manual_seed(0)
model = imerge.distribute(DigitsCNN(), imerge.OptimizerSpec("sgd", lr=0.05, momentum=0.9))
rank, world = model.config.rank, model.config.world_size
train, step = digits("train"), 0
for epoch in range(3):
    for x, y in worker_loader(train, 32, rank, world, seed=0, epoch=epoch):
        tick = time.monotonic()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step += 1
        progress.report(iteration=step, total=3 * 22, loss=loss.item(), seconds=time.monotonic() - tick)
model.close()
