"""A real training loop under IMerge equals one process (each test writes its own single-process reference)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import imerge
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

from loop_reference import assert_same_params, make_data, params_of, train_reference

WORKERS, SHARDS, FEATURES, CLASSES = 2, 2, 8, 4


def cross_entropy(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class SideUse(torch.nn.Module):
    """``side``'s parameters are used through F.linear on the input, never by calling ``side``: its gradient comes
    last in backward, so its pull is the last to land and the next forward reads it first."""

    def __init__(self, outside_from: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(FEATURES, 16)
        self.side = torch.nn.Linear(FEATURES, 16)
        self.head = torch.nn.Linear(16, CLASSES)
        self.outside_from = outside_from  # forwards before this one call ``side`` itself
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        side = self.side(x) if self.calls <= self.outside_from else F.linear(x, self.side.weight, self.side.bias)
        return self.head(torch.tanh(self.body(x) + side))


@pytest.mark.parametrize("spec", [OptimizerSpec("sgd", lr=0.1, momentum=0.9), OptimizerSpec("adam", lr=0.01)],
                         ids=["sgd", "adam"])
def test_a_parameter_used_outside_its_module_is_waited_for(cluster, spec):
    c = cluster(WORKERS, SHARDS)
    data = make_data(12, WORKERS, 16, FEATURES, CLASSES)

    def body(rank: int):
        model = imerge.distribute(SideUse(), spec, c.worker_config(rank))
        for step in data:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module), None

    results = [r[0] for r in c.run_workers(body)]
    reference = SideUse()
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, cross_entropy)
    assert_same_params(results, expected, params_of(SideUse()))


def test_a_use_outside_its_module_that_appears_later_raises_naming_the_parameter(cluster):
    c = cluster(WORKERS, 1)
    data = make_data(3, WORKERS, 16, FEATURES, CLASSES)

    def body(rank: int):
        model = imerge.distribute(SideUse(outside_from=2), OptimizerSpec("sgd", lr=0.1), c.worker_config(rank))
        try:
            for step in data[:2]:
                cross_entropy(model, step[rank]).backward()
            with pytest.raises(UnsupportedUse, match=r"parameter side\.(weight|bias) got a gradient in iteration 2"):
                cross_entropy(model, data[2][rank]).backward()
        finally:
            model.abort()

    c.run_workers(body)
