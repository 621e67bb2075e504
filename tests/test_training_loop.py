"""A real training loop under IMerge equals one process (each test writes its own single-process reference)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

import imerge
import imerge.core.errors
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

from loop_reference import assert_same_params, averaged_grads, make_data, params_of, train_reference

WORKERS, SHARDS, FEATURES, CLASSES = 2, 2, 8, 4
SEEDED = threading.Lock()  # models are built in the workers' threads: one seeded construction at a time


def one_batch():
    return make_data(1, 1, 8, FEATURES, CLASSES)[0][0]


def cross_entropy(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class SideUse(torch.nn.Module):
    """``side``'s parameters are used through F.linear on the input, never by calling ``side``: its gradient comes
    last in backward, so its pull is the last to land and the next forward reads it first."""

    def __init__(self, outside_from: int = 0):
        super().__init__()
        with SEEDED:
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
        return params_of(model.module)

    results = c.run_workers(body)
    reference = SideUse()
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, cross_entropy)
    assert_same_params(results, expected, params_of(SideUse()))


def test_a_use_outside_its_module_that_appears_later_is_waited_for_too(cluster):
    """``side`` is called as a module for two iterations, then read through F.linear: every read of a parameter
    whose block is in flight waits for it, wherever it happens, so the run equals one process."""
    c = cluster(WORKERS, 1)
    data = make_data(6, WORKERS, 16, FEATURES, CLASSES)
    spec = OptimizerSpec("adam", lr=0.01)

    def body(rank: int):
        model = imerge.distribute(SideUse(outside_from=2), spec, c.worker_config(rank))
        for step in data:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    reference = SideUse(outside_from=2)
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, cross_entropy)
    assert_same_params(results, expected, params_of(SideUse()))


class Branchy(torch.nn.Module):
    """``unused`` never gets a gradient; ``sometimes`` only from the batches whose first input is positive (on some
    workers in some steps, on none in others); a LayerNorm and biases for parameter groups."""

    def __init__(self):
        super().__init__()
        with SEEDED:
            torch.manual_seed(0)
            self.body = torch.nn.Linear(FEATURES, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.unused = torch.nn.Linear(16, 16)
            self.sometimes = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.body(x)))
        if x[0, 0] > 0:
            h = h + self.sometimes(h)
        return self.head(h)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norms, as language-model recipes do."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def run_loop(c, make_model, make_optimizer, data, *, schedule=None, **options):
    """Every worker runs the loop a DDP user writes: forward, backward, optimizer.step(), scheduler.step()."""
    def body(rank: int):
        module = make_model()
        optimizer = make_optimizer(module)
        model = imerge.distribute(module, optimizer, c.worker_config(rank, **options))
        stepped = model.optimizer if isinstance(optimizer, OptimizerSpec) else optimizer  # the script's own
        scheduler = schedule(stepped) if schedule else None
        for step in data:
            cross_entropy(model, step[rank]).backward()
            stepped.step()  # nothing left to do: the shards stepped during backward
            stepped.zero_grad()
            if scheduler is not None:
                scheduler.step()
        model.close()
        return params_of(model.module)

    return c.run_workers(body)


def reference_loop(make_model, make_optimizer, data, schedule=None):
    model = make_model()
    optimizer = make_optimizer(model)
    if isinstance(optimizer, OptimizerSpec):
        optimizer = optimizer.build(list(model.parameters()))
    scheduler = schedule(optimizer) if schedule else None
    return train_reference(model, optimizer, data, cross_entropy,
                           after_step=(lambda _: scheduler.step()) if scheduler else None)


def check_loop(cluster, make_optimizer, schedule=None, steps=10, **options):
    c = cluster(3, SHARDS)
    data = make_data(steps, 3, 16, FEATURES, CLASSES, seed=3)
    results = run_loop(c, Branchy, make_optimizer, data, schedule=schedule, **options)
    expected = reference_loop(Branchy, make_optimizer, data, schedule)
    initial = params_of(Branchy())
    assert torch.equal(expected["unused.weight"], initial["unused.weight"])  # never stepped in the reference
    assert_same_params(results, {n: v for n, v in expected.items() if not n.startswith("unused")})
    for worker in results:
        assert torch.equal(worker["unused.weight"], initial["unused.weight"]), "a parameter with no gradient moved"
    return results


def test_a_parameter_no_worker_gave_a_gradient_is_not_stepped_by_adam_with_weight_decay(cluster):
    check_loop(cluster, lambda m: OptimizerSpec("adamw", lr=0.01, weight_decay=0.1))


def test_parameter_groups_of_a_torch_optimizer_train_like_one_process(cluster):
    check_loop(cluster, lambda m: torch.optim.AdamW(decay_groups(m, 0.2), lr=0.02, betas=(0.8, 0.99)))


def test_any_torch_optimizer_by_name_with_its_arguments(cluster):
    check_loop(cluster, lambda m: OptimizerSpec("rmsprop", lr=0.01, momentum=0.5, centered=True,
                                                weight_decay=0.01))


def test_step_lr_on_the_model_optimizer(cluster):
    check_loop(cluster, lambda m: OptimizerSpec("sgd", lr=0.2, momentum=0.9, weight_decay=1e-3),
               schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3))


def test_one_cycle_lr_cycling_momentum_on_the_scripts_own_optimizer(cluster):
    check_loop(cluster, lambda m: torch.optim.SGD(decay_groups(m, 1e-3), lr=0.1, momentum=0.9),
               schedule=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.3, 0.1], total_steps=10))


def test_workers_whose_learning_rates_disagree_are_refused(cluster):
    """The push whose hyperparameters disagree is refused, fatally: the job fails, and the shard ends the pulls
    still waiting for that round at once, with the reason (not at their 60 s timeout), so every worker stops
    within seconds naming it."""
    c = cluster(2, 1)
    data = make_data(4, 2, 16, FEATURES, CLASSES)

    def body(rank: int):
        model = imerge.distribute(Branchy(), OptimizerSpec("sgd", lr=0.1), c.worker_config(rank, pull_timeout_s=60))
        try:
            for index, step in enumerate(data):
                if index == 2:
                    model.optimizer.param_groups[0]["lr"] = 0.1 * (rank + 1)
                cross_entropy(model, step[rank]).backward()
            model.synchronize()
            return None
        except imerge.core.errors.IMergeError as exc:
            return str(exc)
        finally:
            model.abort()

    started = time.monotonic()
    errors = c.run_workers(body)
    assert all(e and "learning-rate (or other) schedules disagree" in e for e in errors), errors
    assert time.monotonic() - started < 20, errors


def accumulated_loss(model: torch.nn.Module, micro_batches) -> torch.Tensor:
    """Backward of every micro-batch but the last (their gradients add up in .grad); the last one's loss."""
    for x, y in micro_batches[:-1]:
        (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    x, y = micro_batches[-1]
    return F.cross_entropy(model(x), y) / len(micro_batches)


def paired_micro_batches(steps: int, seed: int) -> list:
    """``steps`` steps of two micro-batches per worker: data[step][rank] = [(x0, y0), (x1, y1)]."""
    micro = make_data(2 * steps, WORKERS, 8, FEATURES, CLASSES, seed=seed)
    return [[[micro[2 * i][w], micro[2 * i + 1][w]] for w in range(WORKERS)] for i in range(steps)]


def train_with_no_sync(model, data: list, rank: int, **backward) -> None:
    """Each step: the first micro-batch's backward under no_sync, the second's synchronizes (half each)."""
    for step in data:
        (x0, y0), (x1, y1) = step[rank]
        with model.no_sync():
            (F.cross_entropy(model(x0), y0) / 2).backward(**backward)
        (F.cross_entropy(model(x1), y1) / 2).backward(**backward)


def test_no_sync_accumulates_two_micro_batches_into_one_step(cluster):
    c = cluster(WORKERS, SHARDS)
    data = paired_micro_batches(6, seed=5)
    spec = OptimizerSpec("adam", lr=0.01, weight_decay=0.01)

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        train_with_no_sync(model, data, rank)
        iterations = model.engine.iteration
        model.close()
        return params_of(model.module), iterations

    results = c.run_workers(body)
    assert [iterations for _, iterations in results] == [6, 6]  # a micro-batch is not an iteration
    reference = Branchy()
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, accumulated_loss)
    assert_same_params([params for params, _ in results], expected)


def test_with_t_2_every_worker_ends_with_the_same_parameters_after_close(cluster):
    c = cluster(WORKERS, SHARDS)
    data = make_data(5, WORKERS, 16, FEATURES, CLASSES, seed=7)

    def body(rank: int):
        model = imerge.distribute(Branchy(), OptimizerSpec("sgd", lr=0.1), c.worker_config(rank, interleave_period=2))
        for step in data:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    first, second = c.run_workers(body)
    initial = params_of(Branchy())
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between the workers after close()"
    assert not torch.equal(first["head.weight"], initial["head.weight"])


def test_no_sync_with_t_2_is_refused(lone):
    model = lone(Branchy(), interleave_period=2)
    with pytest.raises(UnsupportedUse, match=r"no_sync\(\) \(or require_backward_grad_sync = False\) with --interleave-period > 1"):
        with model.no_sync():
            pass


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        with SEEDED:
            torch.manual_seed(0)
            self.body = torch.nn.Linear(FEATURES, 16)
            self.norm = torch.nn.BatchNorm1d(16)
            self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x))))


@pytest.mark.parametrize("mode", ["broadcast", "average", "off"])
def test_batchnorm_buffers_are_the_same_on_every_worker_at_every_forward(cluster, mode):
    """Non-IID data (each worker's inputs shifted differently) make each worker's running statistics its own;
    with broadcast or average every forward starts from the same buffers, and close() leaves them equal."""
    c = cluster(WORKERS, 1)
    data = make_data(5, WORKERS, 16, FEATURES, CLASSES, seed=9)

    def body(rank: int):
        model = imerge.distribute(Normed(), OptimizerSpec("sgd", lr=0.1), c.worker_config(rank, buffers=mode))
        seen = []
        model.module.register_forward_pre_hook(lambda m, _: seen.append(m.norm.running_mean.clone()))
        for x, y in (step[rank] for step in data):
            F.cross_entropy(model(x + 3.0 * rank), y).backward()
        model.close()
        return seen, dict(model.module.named_buffers())

    (seen0, final0), (seen1, final1) = c.run_workers(body)
    same_each_forward = all(torch.equal(a, b) for a, b in zip(seen0[1:], seen1[1:]))
    same_at_close = all(torch.equal(final0[name], final1[name]) for name in final0)
    if mode == "off":
        assert not same_each_forward and not same_at_close
    else:
        assert same_each_forward and same_at_close
    if mode == "broadcast":
        assert not torch.equal(seen0[1], seen0[2])  # the statistics do move


def test_load_state_dict_then_training_equals_one_process_that_loads_the_same(cluster):
    """Every worker loads a state (rank 1 through the wrapper, rank 0 through its module) after two steps; the
    shards take the loaded parameters, and training goes on from them exactly as in one process."""
    c = cluster(WORKERS, SHARDS)
    data = make_data(6, WORKERS, 16, FEATURES, CLASSES, seed=11)
    loaded = Branchy()
    with torch.no_grad():
        for p in loaded.parameters():
            p.mul_(-0.5).add_(0.01)
    state = loaded.state_dict()
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9)

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        for index, step in enumerate(data):
            if index == 2:
                if rank == 0:
                    model.module.load_state_dict(state)
                else:
                    model.load_state_dict({f"module.{k}": v for k, v in state.items()})
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    reference = Branchy()
    optimizer = spec.build(list(reference.parameters()))
    train_reference(reference, optimizer, data[:2], cross_entropy)
    reference.load_state_dict(state)  # the optimizer keeps its momentum, as with DDP
    expected = train_reference(reference, optimizer, data[2:], cross_entropy)
    assert_same_params(results, {n: v for n, v in expected.items() if not n.startswith("unused")})
    for worker in results:  # "unused" never gets a gradient: it keeps the loaded value
        assert torch.equal(worker["unused.weight"], state["unused.weight"])


def clipped_reference(spec: OptimizerSpec, data, max_norm: float, clip_value: float = 0.0
                      ) -> tuple[torch.nn.Module, list[float]]:
    """One process trained on the averaged gradients, clipped by value and then by norm as a DDP loop clips
    them after backward; with the norms clip_grad_norm_ returned."""
    reference, norms = Branchy(), []
    optimizer = spec.build(list(reference.parameters()))
    for step in data:
        for param, grad in zip(reference.parameters(), averaged_grads(reference, step, cross_entropy)):
            param.grad = grad
        if clip_value:
            torch.nn.utils.clip_grad_value_(reference.parameters(), clip_value)
        if max_norm:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)))
        optimizer.step()
    return reference, norms


def test_clip_grad_norm_with_a_max_norm_that_bites(cluster):
    c = cluster(3, SHARDS)
    data = make_data(8, 3, 16, FEATURES, CLASSES, seed=13)
    spec, max_norm = OptimizerSpec("sgd", lr=0.5, momentum=0.9), 0.05

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        model.clip_grad_norm_(max_norm)  # before the first backward: the shards clip during backward
        norms = []
        for step in data:
            cross_entropy(model, step[rank]).backward()
            norms.append(float(model.clip_grad_norm_(max_norm)))  # where a DDP loop calls it: this round's norm
        model.close()
        return params_of(model.module), norms

    results = c.run_workers(body)
    reference, norms = clipped_reference(spec, data, max_norm)
    assert min(norms) > 4 * max_norm  # it bites every step
    assert_same_params([params for params, _ in results], params_of(reference))
    for _, worker_norms in results:
        assert worker_norms == pytest.approx(norms, rel=1e-5)


def amp_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def make_scaler(kind: str, model, **options) -> torch.amp.GradScaler:
    """The model's grad_scaler(), or torch's own GradScaler made by the script, unchanged."""
    return model.grad_scaler(**options) if kind == "model.grad_scaler()" else torch.amp.GradScaler("cpu", **options)


SCALERS = ["model.grad_scaler()", "torch.amp.GradScaler"]


@pytest.mark.parametrize("kind", SCALERS)
def test_grad_scaler_with_fp16_autocast_skips_the_steps_that_overflow_on_every_shard(cluster, kind):
    c = cluster(WORKERS, SHARDS)
    data = make_data(10, WORKERS, 16, FEATURES, CLASSES, seed=17)
    spec, options = OptimizerSpec("adam", lr=0.01), dict(init_scale=2.0 ** 22, growth_interval=3)

    def body(rank: int):
        module = Branchy()
        optimizer = spec.build(list(module.parameters()))
        model = imerge.distribute(module, optimizer, c.worker_config(rank))
        scaler, scales = make_scaler(kind, model, **options), []
        for step in data:
            scaler.scale(amp_loss(model, step[rank])).backward()
            scales.append(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
        model.close()
        return params_of(model.module), scales

    results = c.run_workers(body)
    reference, scales = Branchy(), []
    optimizer, scaler = spec.build(list(reference.parameters())), torch.amp.GradScaler("cpu", **options)
    for step in data:
        scaled = averaged_grads(reference, step, lambda model, batch: scaler.scale(amp_loss(model, batch)))
        for param, grad in zip(reference.parameters(), scaled):
            param.grad = grad
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
    assert scales[0] > scales[-1] and len(set(scales)) > 2  # steps were skipped (the scale backed off), then grew
    for params, worker_scales in results:
        assert worker_scales == scales
    assert_same_params([params for params, _ in results], params_of(reference))


def test_a_grad_scaler_on_the_model_optimizer_or_another_is_torchs_own_elsewhere(lone):
    """torch's GradScaler steps model.optimizer the shards' way; over an optimizer of another model it is torch's."""
    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = one_batch()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(model.optimizer)
    scaler.step(model.optimizer)
    scaler.update()
    assert scaler.get_scale() == 256.0 and not model.engine.last_round_result().skipped
    other = torch.nn.Linear(2, 2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=1.0)
    before = other.weight.detach().clone()
    scaler.scale(other(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(other_optimizer)
    assert torch.allclose(other.weight.grad, torch.ones(2, 2))  # unscaled locally, as torch does
    scaler.step(other_optimizer)
    assert torch.allclose(other.weight, before - 1.0)


def test_save_then_load_into_another_layout_continues_like_an_uninterrupted_run(cluster, tmp_path):
    """Saved after 4 of 8 steps by a job on 2 shards; loaded by a new job on 1 shard with small partitions (other
    blocks, so the optimizer state is cut anew); its last 4 steps equal the uninterrupted run's."""
    data = make_data(8, WORKERS, 16, FEATURES, CLASSES, seed=19)
    spec, path = OptimizerSpec("adamw", lr=0.02, weight_decay=0.05), tmp_path / "state.safetensors"
    first = cluster(WORKERS, SHARDS)

    def uninterrupted(rank: int):
        model = imerge.distribute(Branchy(), spec, first.worker_config(rank))
        for index, step in enumerate(data):
            if index == 4:
                imerge.save(model, path)
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    expected = first.run_workers(uninterrupted)[0]
    second = cluster(WORKERS, 1)

    def resumed(rank: int):
        model = imerge.distribute(Branchy(), spec, second.worker_config(rank, partition_mib=0.0002))
        info = imerge.load(model, path)
        for step in data[info["iteration"]:]:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module), info["iteration"]

    results = second.run_workers(resumed)
    assert [iteration for _, iteration in results] == [4, 4]
    assert_same_params([params for params, _ in results], expected)


@pytest.mark.parametrize("edit", ["a parameter it lacks", "a state too short"])
def test_a_file_with_optimizer_state_of_a_parameter_the_model_lacks_is_refused_naming_it(lone, tmp_path, edit):
    """Loading it would drop that state silently (a renamed layer): it raises, and nothing is imported."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, edited = tmp_path / "state.safetensors", tmp_path / "edited.safetensors"
    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    x, y = one_batch()
    F.cross_entropy(model(x), y).backward()
    imerge.save(model, path)
    with safe_open(str(path), framework="pt") as handle:
        tensors, metadata = {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()
    momentum = next(k for k in tensors if k.startswith("optim/") and k.endswith("/momentum_buffer"))
    if edit == "a parameter it lacks":
        save_file({**tensors, "optim/ghost.weight/momentum_buffer": tensors[momentum].clone()}, str(edited), metadata)
        with pytest.raises(imerge.core.errors.InvalidArgument, match=r"does not train: ghost\.weight"):
            imerge.load(model, edited)
    else:
        save_file({**tensors, momentum: tensors[momentum][:-1].clone()}, str(edited), metadata)
        with pytest.raises(imerge.core.errors.InvalidArgument, match=r"'momentum_buffer' of .* elements; the param"):
            imerge.load(model, edited)


def test_the_scripts_optimizer_state_dict_is_the_shards_state_in_torchs_format(lone):
    """A DDP script checkpoints optimizer.state_dict() (rank 0 alone): it reads the shards' state, numbered and
    shaped as torch numbers and shapes it, equal to torch's own optimizer trained alike; loading one after
    imerge.distribute is refused, naming what to do instead."""
    module, reference = Branchy(), Branchy()
    own = torch.optim.AdamW([{"params": list(module.parameters())[:2], "weight_decay": 0.0},
                             {"params": list(module.parameters())[2:]}], lr=0.01)
    expected_optimizer = torch.optim.AdamW([{"params": list(reference.parameters())[:2], "weight_decay": 0.0},
                                            {"params": list(reference.parameters())[2:]}], lr=0.01)
    model = lone(module, own)
    for _ in range(3):
        x, y = one_batch()
        own.zero_grad()
        F.cross_entropy(model(x), y).backward()
        own.step()
        expected_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        expected_optimizer.step()
    expected = expected_optimizer.state_dict()
    for optimizer in (own, model.optimizer):
        state = optimizer.state_dict()
        assert state["param_groups"] == expected["param_groups"]
        assert sorted(state["state"]) == sorted(expected["state"])
        for index, by_key in expected["state"].items():
            assert sorted(state["state"][index]) == sorted(by_key)
            for key, value in by_key.items():
                torch.testing.assert_close(state["state"][index][key], value, atol=1e-6, rtol=1e-5)
    with pytest.raises(UnsupportedUse, match=r"load it into the optimizer before imerge.distribute"):
        own.load_state_dict(expected)


CLIP_STYLES = {  # what a DDP loop calls after backward -> (max_norm, clip_value) the reference applies
    "clip_grad_norm_": (0.05, 0.0),
    "clip_grad_value_": (0.0, 0.004),
    "value then norm": (0.05, 0.004),
    "model.clip_grad_norm_": (0.05, 0.0),
}


@pytest.mark.parametrize("style", CLIP_STYLES)
def test_torch_clipping_after_backward_gives_ddps_result_from_the_first_iteration(cluster, style):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), m) / clip_grad_value_ after each backward, as DDP loops
    call them: the shards clip that same round, from the first one (held until the call), the global norm returned
    is the averaged gradient's, and the parameters are the reference's that clips the averaged gradient."""
    c = cluster(3, SHARDS)
    data = make_data(6, 3, 16, FEATURES, CLASSES, seed=13)
    spec = OptimizerSpec("sgd", lr=0.5, momentum=0.9)
    max_norm, clip_value = CLIP_STYLES[style]

    def body(rank: int):
        module = Branchy()
        optimizer = spec.build(list(module.parameters()))
        model = imerge.distribute(module, optimizer, c.worker_config(rank))
        norms = []
        for step in data:
            optimizer.zero_grad()
            cross_entropy(model, step[rank]).backward()
            if clip_value:
                assert torch.nn.utils.clip_grad_value_(model.parameters(), clip_value) is None
            if style == "model.clip_grad_norm_":
                norms.append(float(model.clip_grad_norm_(max_norm)))
            elif max_norm:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            optimizer.step()
        model.close()
        return params_of(model.module), norms

    results = c.run_workers(body)
    reference, norms = clipped_reference(spec, data, max_norm, clip_value)
    unclipped = Branchy()
    train_reference(unclipped, spec.build(list(unclipped.parameters())), data, cross_entropy)
    assert not torch.allclose(params_of(unclipped)["head.weight"], params_of(reference)["head.weight"], atol=1e-3)
    assert_same_params([params for params, _ in results], params_of(reference))
    for _, worker_norms in results:
        assert worker_norms == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("name", ["clip_grad_norm_", "clip_grad_value_"])
def test_torchs_clipping_bound_before_distribute_is_refused_naming_the_fix(lone, name):
    """`from torch.nn.utils import clip_grad_norm_` at a script's top binds torch's own function: over the model's
    gradients it would clip this worker's .grad alone, silently; it raises instead, naming the call that works."""
    function = getattr(torch.nn.utils, name)
    bound = getattr(function, "__wrapped__", function)  # torch's own, as a script that bound it first holds it
    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1))
    x, y = one_batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsupportedUse, match=r"bound before imerge.distribute .* call it as torch.nn.utils"):
        bound(model.parameters(), 1.0)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    bound(other.parameters(), 0.5)  # torch's own elsewhere
    assert float(other.weight.grad.abs().max()) <= 1.0


@pytest.mark.parametrize("kind", SCALERS)
def test_a_grad_scaler_unscaled_then_clipped_after_backward_as_with_torchs(cluster, kind):
    """scaler.scale(loss).backward(); scaler.unscale_(optimizer); clip_grad_norm_(model.parameters()); step;
    update: DDP's order with torch's GradScaler, unchanged; equal to the reference with a fixed scale."""
    c = cluster(2, SHARDS)
    data = make_data(4, 2, 16, FEATURES, CLASSES, seed=5)
    spec, max_norm = OptimizerSpec("sgd", lr=0.5), 0.05

    def body(rank: int):
        module = Branchy()
        optimizer = spec.build(list(module.parameters()))
        model = imerge.distribute(module, optimizer, c.worker_config(rank))
        scaler = make_scaler(kind, model, init_scale=1024.0, growth_interval=1000)
        norms = []
        for step in data:
            optimizer.zero_grad()
            scaler.scale(cross_entropy(model, step[rank])).backward()
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            scaler.step(optimizer)
            scaler.update()
        model.close()
        return params_of(model.module), norms

    results = c.run_workers(body)
    reference, norms = clipped_reference(spec, data, max_norm)
    assert_same_params([params for params, _ in results], params_of(reference))
    for _, worker_norms in results:
        assert worker_norms == pytest.approx(norms, rel=1e-4)


@pytest.mark.parametrize("change", ["another max_norm", "clipping stops", "clipping starts late", "part of the model"])
def test_clipping_that_changes_after_the_first_round_is_refused_naming_the_round(lone, change):
    """Rounds after the first leave during backward with the first round's clipping: a call that asks otherwise
    raises, naming the round, rather than differ silently from DDP."""
    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1))
    x, y = one_batch()
    F.cross_entropy(model(x), y).backward()
    if change != "clipping starts late":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsupportedUse) as refused:
        if change == "another max_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        elif change == "clipping stops":
            F.cross_entropy(model(x), y).backward()
        elif change == "clipping starts late":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    expected = {"another max_norm": r"clip_grad_norm_\(2\) after the backward of iteration 1, .* clipped to the "
                                    r"norm at 1",
                "clipping stops": r"not after the backward of iteration 1",
                "clipping starts late": r"iteration 1, whose gradients left during that backward not clipped",
                "part of the model": r"over 2 of the model's \d+ trained parameters"}[change]
    assert refused.match(expected)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)) > 0  # torch's own elsewhere


def test_grad_is_this_workers_gradient_until_the_next_forward_and_a_local_step_changes_nothing(lone):
    """CPU, T = 1: every .grad is a view of the accumulator (autograd adds into it, nothing is copied per gradient).
    After backward it holds this worker's own gradient (not the average, which never exists on a worker) until the
    next forward, as a DDP loop that logs gradient norms expects; a parameter without gradient has none. The
    script's own optimizer.step() (weight decay included) changes nothing and leaves the gradients."""
    module = Branchy()
    own = torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=0.5)
    model = lone(module, own)
    reference = Branchy()
    x, y = one_batch()
    F.cross_entropy(reference(x), y).backward()
    loss = F.cross_entropy(model(x), y)
    storage = model.engine.flat.grads.untyped_storage().data_ptr()
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == storage
               for p in model.module.parameters())
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in model.module.named_parameters():  # read at once: no synchronize
        if expected[name] is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, expected[name], atol=1e-6, rtol=0, msg=name)
    model.synchronize()  # the shards' step (the first round waited for the script's clipping until here)
    before = params_of(model.module)
    own.step()
    assert all(torch.equal(value, params_of(model.module)[name]) for name, value in before.items())
    torch.testing.assert_close(model.module.head.weight.grad, expected["head.weight"], atol=1e-6, rtol=0)
    own.zero_grad()
    assert all(p.grad is None for p in model.module.parameters())
    current = Branchy()
    current.load_state_dict(params_of(model.module))  # the stepped parameters (a read waits for them)
    F.cross_entropy(current(x), y).backward()
    F.cross_entropy(model(x), y).backward()  # the next iteration's gradient, from zero
    torch.testing.assert_close(model.module.head.weight.grad, current.head.weight.grad, atol=1e-6, rtol=0)


class Gate:
    """A device copy that completes only when the test says so (the seam a CUDA event fills)."""

    def __init__(self):
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def test_a_group_completion_returns_before_its_copy_and_the_push_waits_for_it(lone):
    """A group's completion hands its device copy to the staging and returns: backward ends with every copy
    still pending, nothing is pushed until they complete, and then the sync goes through."""
    from imerge.worker.staging import HostStaging

    class GatedStaging(HostStaging):
        def __init__(self, flat):
            super().__init__(flat)
            self.gates: list[Gate] = []

        def group_complete(self, offset: int, numel: int) -> Gate:
            self.gates.append(Gate())
            return self.gates[-1]

    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1))
    x, y = one_batch()
    F.cross_entropy(model(x), y).backward()  # the first round (held for the script's clipping until the next forward)
    model.synchronize()
    staging = model.engine.comm.staging = GatedStaging(model.engine.flat)

    def groups_pushed_in_the_second_round() -> set[int]:  # (the first round's pushes may still be logging theirs)
        return {i.args["group"] for i in model.engine.timeline.of("push") if i.args["iteration"] == 1}

    F.cross_entropy(model(x), y).backward()
    assert len(staging.gates) == len(model.engine.groups)  # every group completed in backward...
    assert not any(gate.query() for gate in staging.gates)  # ...and backward returned, its copies pending
    time.sleep(0.3)
    assert groups_pushed_in_the_second_round() == set()  # nothing left before its copy is done
    for gate in staging.gates:
        gate.done.set()
    model.synchronize()  # (the pulls are done; a push's acknowledgement may reach the timeline a moment later)
    deadline = time.monotonic() + 10
    while len(groups_pushed_in_the_second_round()) < len(model.engine.groups) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(groups_pushed_in_the_second_round()) == len(model.engine.groups)


def test_backward_with_create_graph_under_no_sync_counts_each_gradient_once(cluster):
    """create_graph makes autograd replace .grad out of place (view + gradient) instead of adding in place."""
    c = cluster(WORKERS, 1)
    data = paired_micro_batches(4, seed=23)
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9)

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        train_with_no_sync(model, data, rank, create_graph=True)
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    reference = Branchy()
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, accumulated_loss)
    assert_same_params(results, expected)


@pytest.mark.parametrize("link_mbps, blocks", [(100.0, 64), (1000.0, 8), (10000.0, 1)])
def test_the_workers_link_sets_the_blocks_where_no_partition_is_given(lone, link_mbps, blocks):
    """--partition-mib 0 (the default): an 8 MiB layer in blocks of the power of two nearest to 8 ms of the
    link: 128 KiB on a 100 Mbit/s link, 1 MiB on a 1 Gbit/s one, one block of 8 MiB on a 10 Gbit/s one."""
    model = lone(torch.nn.Linear(2048, 1024, bias=False), link_mbps=link_mbps)
    assert [block.numel * 4 for block in model.engine.plan.blocks] == [(8 << 20) // blocks] * blocks
