"""Uses of the wrapped model that would train wrongly are refused at once, naming the cause."""
from __future__ import annotations

import time

import pytest
import torch

import imerge
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec
from imerge.workloads.models import build_model


def test_a_second_backward_without_a_forward_raises_at_once_on_that_rank(cluster):
    """Two backward passes of one forward would be two optimizer steps on the shards (and, on one rank only, a
    job out of step): the second raises on that rank before anything is pushed, while the other rank trains on."""
    c = cluster(2, 1)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))

    def body(rank: int):
        model = imerge.distribute(build_model("digits-cnn"), OptimizerSpec("sgd", lr=0.05), c.worker_config(rank))
        try:
            for _ in range(2):
                torch.nn.functional.cross_entropy(model(x), y).backward()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward(retain_graph=True)
            if rank == 1:
                started = time.monotonic()
                with pytest.raises(UnsupportedUse, match="second backward after iteration 3 without a forward"):
                    loss.backward()
                refused_after_s = time.monotonic() - started
                model.synchronize()  # the third iteration's sync still completes
                return refused_after_s, model.engine.iteration
            model.synchronize()
            return 0.0, model.engine.iteration
        finally:
            model.abort()

    (_, iterations0), (refused_after_s, iterations1) = c.run_workers(body)
    assert refused_after_s < 1.0 and iterations0 == iterations1 == 3  # refused, not counted as an iteration
