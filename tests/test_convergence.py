"""Convergence on real data: the scikit-learn digits, 2 workers and 2 shards."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from imerge.workloads.data import make_dataset
from imerge.workloads.models import build_model
from imerge.worker.job import run_job
from imerge.workloads.job import JobConfig, accuracy

EPOCHS, BATCH, WORKERS = 10, 32, 2


def single_process_accuracy(job: JobConfig) -> float:
    """The same epochs in one process, with the global batch of all workers."""
    train = make_dataset("digits", "digits-cnn", "train", job.seed)
    model = build_model("digits-cnn", job.seed)
    optimizer = job.optimizer_spec().build(list(model.parameters()))
    for epoch in range(job.epochs):
        sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=job.seed, drop_last=True)
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=BATCH * WORKERS, sampler=sampler, drop_last=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return accuracy(model, make_dataset("digits", "digits-cnn", "test", job.seed))


def test_digits_reach_95_percent_within_a_point_of_single_process_and_period_two_within_two_points(cluster):
    """One T = 1 run answers both questions: is it within a point of one process, and is T = 2 within two points
    of it."""
    job = JobConfig(model="digits-cnn", data="digits", epochs=EPOCHS, batch_size=BATCH, lr=0.05, momentum=0.9)
    accuracy_of = {}
    for period in (1, 2):
        c = cluster(WORKERS, 2)
        summaries = c.run_workers(lambda rank: run_job(c.worker_config(rank, interleave_period=period), job),
                                  timeout_s=300)
        accuracy_of[period] = summaries[0]["test_accuracy"]
        assert summaries[0]["iterations"] == summaries[1]["iterations"] == EPOCHS * (1437 // (BATCH * WORKERS))
    reference = single_process_accuracy(job)
    print(f"digits test accuracy after {EPOCHS} epochs: T=1 {accuracy_of[1]:.4f}, T=2 {accuracy_of[2]:.4f}, "
          f"single process {reference:.4f}")
    assert accuracy_of[1] >= 0.95
    assert abs(accuracy_of[1] - reference) <= 0.01
    assert abs(accuracy_of[2] - accuracy_of[1]) <= 0.02
