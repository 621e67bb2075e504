"""Single-process references for the training-loop tests: what one process computes from the workers' data."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def averaged_grads(model: torch.nn.Module, step: Sequence[Batch],
                   loss_of: Callable[[torch.nn.Module, Batch], torch.Tensor]) -> list[torch.Tensor | None]:
    """Each worker's gradient summed in rank order and divided by the worker count, as the shards do; a
    parameter that no worker gave a gradient keeps ``None`` (torch.optim skips it); one that some workers
    gave none counts zero for them."""
    grads: list[list[torch.Tensor | None]] = []
    for batch in step:
        model.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    averaged: list[torch.Tensor | None] = []
    for index, param in enumerate(model.parameters()):
        given = [g[index] for g in grads]
        if all(g is None for g in given):
            averaged.append(None)
            continue
        total = torch.zeros_like(param) if given[0] is None else given[0].clone()
        for g in given[1:]:
            total.add_(torch.zeros_like(param) if g is None else g)
        averaged.append(total.div_(len(step)))
    return averaged


def train_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Sequence[Sequence[Batch]],
                    loss_of: Callable[[torch.nn.Module, Batch], torch.Tensor],
                    after_step: Callable[[int], Any] | None = None) -> dict[str, torch.Tensor]:
    """Train ``model`` on every step's averaged gradient; ``after_step(i)`` runs after each optimizer step."""
    for index, step in enumerate(data):
        for param, grad in zip(model.parameters(), averaged_grads(model, step, loss_of)):
            param.grad = grad
        optimizer.step()
        if after_step is not None:
            after_step(index)
    return params_of(model)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def assert_same_params(results: Sequence[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor],
                       initial: dict[str, torch.Tensor] | None = None, atol: float = 1e-5) -> None:
    for worker, params in enumerate(results):
        for name, value in expected.items():
            if initial is not None:
                assert not torch.equal(value, initial[name]), f"{name} never trained in the reference"
            torch.testing.assert_close(params[name], value, atol=atol, rtol=0,
                                       msg=lambda m, w=worker, n=name: f"worker {w}, {n}: {m}")


def make_data(steps: int, workers: int, batch: int, features: int, classes: int, seed: int = 1) -> list[list[Batch]]:
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, features, generator=generator),
              torch.randint(0, classes, (batch,), generator=generator)) for _ in range(workers)]
            for _ in range(steps)]
