"""What a DDP script does besides forward and backward either works as under DDP or raises naming the cause."""
from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import imerge
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

from loop_reference import make_data, params_of, train_reference
from test_training_loop import SEEDED, Branchy, Normed, accumulated_loss, cross_entropy, decay_groups, \
    paired_micro_batches

WORKERS, FEATURES, CLASSES = 2, 8, 4


def assert_params(results, expected, atol=1e-5, skip="unused"):
    for worker, params in enumerate(results):
        for name, value in expected.items():
            if not name.startswith(skip):
                torch.testing.assert_close(params[name], value, atol=atol, rtol=0, msg=f"worker {worker}, {name}")


def test_an_optimizer_built_after_distribute_is_the_one_the_shards_run(cluster):
    """DDP's tutorial order: wrap, then build the optimizer over the wrapped model's parameters (two groups)."""
    c = cluster(WORKERS, 2)
    data = make_data(6, WORKERS, 16, FEATURES, CLASSES, seed=41)

    def body(rank: int):
        model = imerge.distribute(Branchy(), config=c.worker_config(rank))
        optimizer = torch.optim.AdamW(decay_groups(model.module, 0.1), lr=0.02)
        for step in data:
            cross_entropy(model, step[rank]).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    reference = Branchy()
    expected = train_reference(reference, torch.optim.AdamW(decay_groups(reference, 0.1), lr=0.02), data,
                               cross_entropy)
    assert_params(results, expected)


def test_without_any_optimizer_the_default_is_named_in_one_line(lone, caplog):
    with caplog.at_level(logging.WARNING, logger="imerge.worker.api"):
        model = lone(Branchy(), None)
        model(torch.randn(4, FEATURES))
    lines = [r.getMessage() for r in caplog.records if "no optimizer was given" in r.getMessage()]
    assert len(lines) == 1 and "the shards run OptimizerSpec('sgd', lr=0.01)" in lines[0], lines


def test_optimizers_that_would_silently_do_nothing_raise_naming_the_cause(lone):
    module = Branchy()
    model = lone(module, None)
    first = torch.optim.Adam(module.parameters(), lr=0.01)
    with pytest.raises(UnsupportedUse, match=r"a second optimizer over the distributed model's parameters: SGD"):
        torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = make_data(1, 1, 8, FEATURES, CLASSES)[0][0]
    F.cross_entropy(model(x), y).backward()
    assert model.optimizer.spec.name == "adam" and model.optimizer.param_groups is first.param_groups
    with pytest.raises(UnsupportedUse, match=r"built after the job started"):
        torch.optim.SGD(module.head.parameters(), lr=0.1)  # a local optimizer over part of the model
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # another model's: none of IMerge's business


def test_a_spec_beside_a_torch_optimizer_over_the_model_raises(lone):
    module = Branchy()
    own = torch.optim.Adam(module.parameters(), lr=0.01)  # built before distribute, kept by the script
    with pytest.raises(UnsupportedUse, match=r"a second optimizer .*: Adam \(lr 0.01\) beside the spec"):
        lone(module, OptimizerSpec("sgd", lr=0.1))
    del own


def test_a_checkpoints_optimizer_state_loaded_before_distribute_goes_to_the_shards(cluster):
    """nanoGPT's resume: build the model, load its state; build the optimizer, load its state; then wrap. The
    run goes on exactly as one process that kept training."""
    c = cluster(WORKERS, 2)
    data = make_data(8, WORKERS, 16, FEATURES, CLASSES, seed=43)
    make_optimizer = lambda m: torch.optim.AdamW(decay_groups(m, 0.05), lr=0.02, betas=(0.8, 0.95))  # noqa: E731
    reference = Branchy()
    optimizer = make_optimizer(reference)
    train_reference(reference, optimizer, data[:4], cross_entropy)
    checkpoint = copy.deepcopy({"model": reference.state_dict(), "optimizer": optimizer.state_dict()})
    expected = train_reference(reference, optimizer, data[4:], cross_entropy)

    def body(rank: int):
        module = Branchy()
        module.load_state_dict(checkpoint["model"])
        own = make_optimizer(module)
        own.load_state_dict(checkpoint["optimizer"])
        model = imerge.distribute(module, config=c.worker_config(rank))
        for step in data[4:]:
            cross_entropy(model, step[rank]).backward()
            own.step()
        model.close()
        return params_of(model.module)

    assert_params(c.run_workers(body), expected)


def test_require_backward_grad_sync_accumulates_as_in_ddp(cluster):
    """nanoGPT's idiom: model.require_backward_grad_sync = (micro_step == last) before each micro-batch's
    forward; one optimizer step per iteration."""
    c = cluster(WORKERS, 1)
    data = paired_micro_batches(5, seed=47)
    spec = OptimizerSpec("adam", lr=0.01)

    def body(rank: int):
        model = imerge.distribute(Branchy(), spec, c.worker_config(rank))
        for step in data:
            for micro, (x, y) in enumerate(step[rank]):
                model.require_backward_grad_sync = micro == len(step[rank]) - 1
                (F.cross_entropy(model(x), y) / 2).backward()
            model.optimizer.step()
        iterations = model.engine.iteration
        model.close()
        return params_of(model.module), iterations

    results = c.run_workers(body)
    assert [iterations for _, iterations in results] == [5, 5]
    reference = Branchy()
    expected = train_reference(reference, spec.build(list(reference.parameters())), data, accumulated_loss)
    assert_params([params for params, _ in results], expected)


@pytest.mark.parametrize("caught_at", ["step", "backward"])
def test_accumulating_over_several_backwards_without_no_sync_raises(lone, caught_at):
    """DDP syncs every backward and sums the averaged gradients in .grad until step(); IMerge would take a step per
    backward. Caught at step() in the first accumulation, and at the second backward from then on."""
    module = Branchy()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = lone(module, optimizer)
    (x0, y0), (x1, y1) = make_data(2, 1, 8, FEATURES, CLASSES)[0][0], make_data(2, 1, 8, FEATURES, CLASSES)[1][0]
    if caught_at == "step":
        F.cross_entropy(model(x0), y0).backward()
        F.cross_entropy(model(x1), y1).backward()
        with pytest.raises(UnsupportedUse, match=r"optimizer.step\(\) after several backward passes"):
            optimizer.step()
        return
    F.cross_entropy(model(x0), y0).backward()
    optimizer.step()  # one backward, one step: fine
    F.cross_entropy(model(x0), y0).backward()
    loss = F.cross_entropy(model(x1), y1)
    with pytest.raises(UnsupportedUse, match=r"a second backward since the last optimizer.step\(\)"):
        loss.backward()


def test_save_stores_the_shards_fp32_parameters_under_compressed_pulls(lone, tmp_path):
    """With fp16 pulls the workers hold rounded copies; the file holds the shards' fp32 masters."""
    from safetensors.torch import load, load_file

    model = lone(Branchy(), OptimizerSpec("adam", lr=0.003), compression="fp16")
    for x, y in (step[0] for step in make_data(3, 1, 16, FEATURES, CLASSES, seed=53)):
        F.cross_entropy(model(x), y).backward()
    imerge.save(model, tmp_path / "state.safetensors")
    saved = load_file(str(tmp_path / "state.safetensors"))
    masters = torch.cat([load(data)["param"] for data in
                         (model.engine.export_states()[b.block_id]
                          for b in sorted(model.plan.blocks, key=lambda b: b.offset))])
    held = params_of(model.module)
    differs = 0
    for name, param in model.module.named_parameters():
        offset, numel = model.engine.flat.range[id(param)]
        assert torch.equal(saved[f"model/{name}"], masters[offset:offset + numel].reshape(param.shape)), name
        differs += int(not torch.equal(saved[f"model/{name}"], held[name]))
    assert differs > 0  # the rounded copies are not what was saved


class Backbone(torch.nn.Module):
    """A pretrained-style backbone (BatchNorm statistics included) and a trainable head."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16))
        self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def test_worker_0s_frozen_parameters_and_buffers_are_every_workers_at_join_and_after_load(cluster, tmp_path):
    """Ranks built with different seeds; rank 0 loads 'pretrained' weights and freezes the backbone (the usual
    fine-tuning start), then every rank wraps. As DDP's construction broadcasts them, rank 0's frozen parameters
    and buffers are everyone's; after imerge.load too."""
    c = cluster(WORKERS, 1)
    pretrained = Backbone(seed=100)
    with torch.no_grad():
        pretrained.backbone[1].running_mean.uniform_(-1, 1)
    data = make_data(4, WORKERS, 16, FEATURES, CLASSES, seed=59)
    spec = OptimizerSpec("sgd", lr=0.1)
    other = Backbone(seed=200)
    with torch.no_grad():
        other.backbone[1].running_var.uniform_(2, 3)
    file = tmp_path / "other.safetensors"
    written = threading.Barrier(WORKERS)

    def body(rank: int):
        with SEEDED:
            module = Backbone(seed=rank)
        if rank == 0:
            module.load_state_dict(pretrained.state_dict())
        module.backbone.requires_grad_(False)
        model = imerge.distribute(module, spec, c.worker_config(rank, buffers="off"))
        joined = {k: v.clone() for k, v in model.module.state_dict().items()}
        model.eval()
        for step in data:
            cross_entropy(model, step[rank]).backward()
        if rank == 0:
            saved = Backbone(seed=300)
            saved.load_state_dict(other.state_dict())
            saved.backbone.requires_grad_(False)
            tensors = {f"model/{k}": v for k, v in saved.state_dict().items()}
            from safetensors.torch import save_file
            save_file(tensors, str(file), {"format": "imerge-save-1", "iteration": "4",
                                           "optimizer": model.optimizer.spec.to_json(), "world_size": "2"})
        written.wait(30)
        imerge.load(model, file)
        loaded = {k: v.clone() for k, v in model.module.state_dict().items()}
        model.close()
        return joined, loaded

    results = c.run_workers(body)
    for joined, loaded in results:
        for key, value in pretrained.state_dict().items():
            if key.startswith("backbone"):
                assert torch.equal(joined[key], value), f"at join: {key}"
        for key, value in other.state_dict().items():
            assert torch.equal(loaded[key], value), f"after imerge.load: {key}"


def test_top_k_never_steps_a_module_nobody_used(cluster):
    """An all-zero block sends no zeros: ``unused`` keeps its initial values under Adam with weight decay."""
    c = cluster(WORKERS, 1)
    data = make_data(4, WORKERS, 16, FEATURES, CLASSES, seed=61)

    def body(rank: int):
        model = imerge.distribute(Branchy(), OptimizerSpec("adamw", lr=0.01, weight_decay=0.5),
                                  c.worker_config(rank, compression="topk", fusion="none"))
        for step in data:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    initial = params_of(Branchy())
    for worker in c.run_workers(body):
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(worker[name], initial[name]), name
        assert not torch.equal(worker["head.weight"], initial["head.weight"])


def test_normed_model_buffers_stay_in_step_with_a_lazily_joined_optimizer(cluster):
    """The optimizer built after distribute, BatchNorm buffers broadcast: a smoke test of the lazy join with
    buffers, against the reference's parameters."""
    c = cluster(WORKERS, 1)
    data = make_data(3, WORKERS, 16, FEATURES, CLASSES, seed=67)

    def body(rank: int):
        model = imerge.distribute(Normed(), config=c.worker_config(rank))
        torch.optim.SGD(model.parameters(), lr=0.1)
        for step in data:
            cross_entropy(model, step[rank]).backward()
        model.close()
        return params_of(model.module)

    results = c.run_workers(body)
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
    assert not torch.equal(results[0]["head.weight"], params_of(Normed())["head.weight"])


def test_a_worker_of_another_run_is_refused_before_it_touches_the_job(cluster):
    """The coordinator holds the job's lease for its run; a worker with another run's token raises JobTaken before
    it claims a rank or registers (a worker with no token checks nothing: it cannot tell)."""
    import time

    from imerge.control.store import Store
    from imerge.core.errors import JobTaken

    c = cluster(1, 1)
    store = Store(c.redis_url, c.job)
    try:
        deadline = time.monotonic() + 30
        while store.job_lease() is None:
            assert time.monotonic() < deadline, "the coordinator took no lease"
            time.sleep(0.05)
        with pytest.raises(JobTaken, match=rf"job {c.job} is running in this Redis under another run"):
            imerge.distribute(Branchy(), OptimizerSpec("sgd", lr=0.1), c.worker_config(0, job_token="another-run"))
        assert store.member_generations(1, 0) == {}  # nothing registered
    finally:
        store.close()


def test_at_exit_an_open_model_closes_after_a_normal_end_and_aborts_after_an_exception(cluster):
    """The exit hook of a script without model.close(): its last sync and done mark when the script ended
    normally; none when an uncaught exception ended it (the job then recovers without it)."""
    from imerge.control.store import Store
    from imerge.worker import exiting

    c = cluster(1, 1)
    store = Store(c.redis_url, c.job)
    x, y = make_data(1, 1, 8, FEATURES, CLASSES)[0][0]
    try:
        model = imerge.distribute(Branchy(), OptimizerSpec("sgd", lr=0.1), c.worker_config(0))
        F.cross_entropy(model(x), y).backward()
        exiting.uncaught.append(RuntimeError("the script failed"))
        try:
            exiting.leave_at_exit()
        finally:
            exiting.uncaught.clear()
        assert model._closed and store.done_ranks() == set()
        second = cluster(1, 1)
        store.close()
        store = Store(second.redis_url, second.job)
        model = imerge.distribute(Branchy(), OptimizerSpec("sgd", lr=0.1), second.worker_config(0))
        F.cross_entropy(model(x), y).backward()
        exiting.leave_at_exit()
        assert model._closed and store.done_ranks() == {0}
    finally:
        store.close()
