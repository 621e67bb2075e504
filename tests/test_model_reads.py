"""Whatever a training script reads of the model is the shards' latest step, wherever it reads it.

Each test slows rank 1 before its backward, so that rank 0 reads its parameters while their round is still
open on the shards: a read that did not wait for its block would see the parameters of the step before.
"""
from __future__ import annotations

import copy
import io
import time

import pytest
import torch
import torch.nn.functional as F

import imerge
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

from loop_reference import averaged_grads, make_data, params_of
from test_training_loop import SEEDED, Branchy, cross_entropy

WORKERS, FEATURES, CLASSES = 2, 8, 4
LAG_S = 0.05  # rank 1 sleeps this long before each backward


class EarlyRead(torch.nn.Module):
    """``late.weight`` is read (F.linear on the input) before ``late`` itself is called, later in the forward; its
    gradient is complete only at the end of backward, so its block is the last to come back."""

    def __init__(self):
        super().__init__()
        with SEEDED:
            torch.manual_seed(0)
            self.body = torch.nn.Linear(FEATURES, FEATURES)
            self.late = torch.nn.Linear(FEATURES, FEATURES)
            self.head = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = F.linear(x, self.late.weight)
        h = torch.tanh(self.body(x) + early)
        return self.head(torch.tanh(self.late(h)))


def reference_steps(make_model, spec: OptimizerSpec, data) -> list[dict[str, torch.Tensor]]:
    """The single-process parameters after each step."""
    model = make_model()
    optimizer = spec.build(list(model.parameters()))
    after = []
    for step in data:
        for param, grad in zip(model.parameters(), averaged_grads(model, step, cross_entropy)):
            param.grad = grad
        optimizer.step()
        after.append(params_of(model))
    return after


def lagging_backward(loss: torch.Tensor, rank: int) -> None:
    if rank == 1:
        time.sleep(LAG_S)
    loss.backward()


def test_a_parameter_read_before_its_own_module_is_called_waits_for_its_block(cluster):
    c = cluster(WORKERS, 1)
    data = make_data(12, WORKERS, 16, FEATURES, CLASSES, seed=29)
    spec = OptimizerSpec("adam", lr=0.01)

    def body(rank: int):
        model = imerge.distribute(EarlyRead(), spec, c.worker_config(rank, fusion="none"))
        for step in data:
            lagging_backward(cross_entropy(model, step[rank]), rank)
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    expected = reference_steps(EarlyRead, spec, data)[-1]
    for worker in results:
        for name, value in expected.items():
            torch.testing.assert_close(worker[name], value, atol=1e-5, rtol=0, msg=name)


READS = {  # each returns the parameters (by name) as the script sees them right after its step
    "state_dict": lambda model: {k: v.clone() for k, v in model.module.state_dict().items()},
    "parameters": lambda model: {n: p.clone() for n, p in zip(dict(model.module.named_parameters()),
                                                               model.module.parameters())},
    "named_parameters": lambda model: {n: p.detach().clone() for n, p in model.module.named_parameters()},
    "data": lambda model: {n: p.data.clone() for n, p in model.module.named_parameters()},
    "deepcopy": lambda model: {n: p.detach() for n, p in copy.deepcopy(model.module).named_parameters()},
    "torch.save": lambda model: _saved(model.module),
    "numpy": lambda model: {n: torch.from_numpy(p.detach().numpy().copy())
                            for n, p in model.module.named_parameters()},
}


def _saved(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    stream = io.BytesIO()
    torch.save(module.state_dict(), stream)
    stream.seek(0)
    return torch.load(stream, weights_only=True)


def test_every_read_right_after_the_step_is_the_steps_result(cluster):
    """A DDP loop's reads after optimizer.step(), one kind per iteration, and an EMA updated every iteration; an
    evaluation forward's output too. None synchronizes first."""
    c = cluster(WORKERS, 2)
    data = make_data(2 * len(READS), WORKERS, 16, FEATURES, CLASSES, seed=31)
    spec, decay = OptimizerSpec("adamw", lr=0.02, weight_decay=0.05), 0.8
    probe = data[0][0][0]

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        ema = copy.deepcopy(model.module)
        seen, ema_seen, evaluated = [], [], []
        for index, step in enumerate(data):
            lagging_backward(cross_entropy(model, step[rank]), rank)
            model.optimizer.step()
            model.optimizer.zero_grad()
            if rank == 0:
                seen.append(list(READS.values())[index % len(READS)](model))
                with torch.no_grad():
                    for target, source in zip(ema.parameters(), model.module.parameters()):
                        target.mul_(decay).add_(source, alpha=1 - decay)
                ema_seen.append(params_of(ema))
                model.eval()
                with torch.no_grad():
                    evaluated.append(model(probe))
                model.train()
        model.close()
        return seen, ema_seen, evaluated

    (seen, ema_seen, evaluated), _ = c.run_workers(body)
    expected = reference_steps(Branchy, spec, data)
    reference, ema = Branchy(), Branchy()
    for index, (after, read, averaged) in enumerate(zip(expected, seen, ema_seen)):
        kind = list(READS)[index % len(READS)]
        for name, value in after.items():
            torch.testing.assert_close(read[name], value, atol=1e-6, rtol=0, msg=f"{kind}, step {index}: {name}")
        reference.load_state_dict(after)
        with torch.no_grad():
            for target, source in zip(ema.parameters(), reference.parameters()):
                target.mul_(decay).add_(source, alpha=1 - decay)
            torch.testing.assert_close(evaluated[index], reference(probe), atol=1e-6, rtol=0,
                                       msg=f"evaluation after step {index}")
        for name, value in params_of(ema).items():
            torch.testing.assert_close(averaged[name], value, atol=1e-6, rtol=0, msg=f"EMA after step {index}")


def test_freezing_and_unfreezing_after_distribute_trains_like_one_process(cluster):
    """Parameters frozen after imerge.distribute are not stepped (as torch.optim skips a None gradient) and train
    again once unfrozen; one frozen when the model was distributed is not the shards': unfreezing it raises."""
    c = cluster(WORKERS, 1)
    data = make_data(8, WORKERS, 16, FEATURES, CLASSES, seed=37)
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9)

    def toggle(module: torch.nn.Module, index: int) -> None:
        if index == 3:
            module.body.requires_grad_(False)
        if index == 6:
            module.body.requires_grad_(True)

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        for index, step in enumerate(data):
            toggle(model.module, index)
            lagging_backward(cross_entropy(model, step[rank]), rank)
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    reference = Branchy()
    optimizer = spec.build(list(reference.parameters()))
    for index, step in enumerate(data):
        toggle(reference, index)
        optimizer.zero_grad()
        for param, grad in zip(reference.parameters(), averaged_grads(reference, step, cross_entropy)):
            param.grad = grad
        optimizer.step()
    for worker in results:
        for name, value in params_of(reference).items():
            if not name.startswith("unused"):
                torch.testing.assert_close(worker[name], value, atol=1e-5, rtol=0, msg=name)


def test_unfreezing_a_parameter_frozen_when_the_model_was_distributed_raises_naming_it(lone):
    module = Branchy()
    module.head.requires_grad_(False)
    model = lone(module)
    x, y = make_data(1, 1, 8, FEATURES, CLASSES)[0][0]
    F.cross_entropy(model(x), y).backward()
    model.module.head.weight.requires_grad_(True)
    with pytest.raises(UnsupportedUse, match=r"parameter head\.weight was frozen .* when the model was distributed"):
        model(x)


def test_writes_that_the_shards_would_undo_raise_naming_the_parameter(lone):
    """The shards hold the parameters: a new .data, a move, or an in-place change on one worker would be undone
    by the next pull (or train the old storage); each raises before it happens, naming the parameter."""
    model = lone(Branchy())
    with pytest.raises(UnsupportedUse, match=r"parameter head\.weight: p\.data reassigned"):
        model.module.head.weight.data = torch.zeros(CLASSES, 16)
    with pytest.raises(UnsupportedUse, match=r"parameter body\.bias: an in-place zero_\(\)"):
        torch.nn.init.zeros_(model.module.body.bias)
    with pytest.raises(UnsupportedUse, match=r"parameter head\.bias: an in-place add_\(\)"):
        with torch.no_grad():
            model.module.head.bias += 1
    model.to("cpu")  # where it is already: nothing moves
    state = {k: torch.zeros_like(v) for k, v in model.module.state_dict().items()}
    model.module.load_state_dict(state)  # the way to change parameters: they go to the shards
    assert all(float(p.detach().abs().sum()) == 0 for p in model.module.parameters())
