"""The IMerge scheduler end to end: fusion, priority, slots and interleaving on real servers."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
import redis
import torch
from torch import nn

import imerge
from imerge.core.optim import OptimizerSpec
from imerge.core.schedule import syncs

import test_equivalence as eq

SMALL_CAPS = dict(size_cap_mib=0.05, first_cap_mib=0.005, partition_mib=0.05, profile_iters=4)


# Pairwise: every (fusion, slots) pair, with priority alternating so that each fusion and each slot policy also
# runs with and without it (9 runs cover every pair of values the full 18 would).
PAIRWISE = [(fusion, (i + j) % 2 == 0, slots) for i, fusion in enumerate(["none", "size", "cost"])
            for j, slots in enumerate(["off", "fixed", "ack"])]


@pytest.mark.parametrize("fusion, priority, slots", PAIRWISE)
def test_equivalence_for_every_scheduler_combination(cluster, fusion, priority, slots):
    data = eq.batches()
    c = cluster(eq.WORKERS, eq.SHARDS)
    results = eq.distributed_run(c, eq.OPTIMIZERS["sgd"], data, fusion=fusion, priority=priority, slots=slots,
                                 tune="none", **SMALL_CAPS)  # this combination, as given
    expected = eq.reference_run(eq.OPTIMIZERS["sgd"], data)
    plan = c.coordinator.plan
    assert plan.version == (2 if fusion == "cost" else 1)
    assert len(plan.blocks) > len(plan.units)  # the large layer was partitioned
    if fusion == "size":
        assert len(plan.groups) < len(plan.units)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("scope, width", [("group", 1), ("shard", 1), ("shard", 2)])
def test_equivalence_for_every_slot_scope_and_width(cluster, scope, width):
    data = eq.batches()
    c = cluster(eq.WORKERS, eq.SHARDS)
    results = eq.distributed_run(c, eq.OPTIMIZERS["adam"], data, fusion="cost", slots="ack", slot_scope=scope,
                                 slot_width=width, **SMALL_CAPS)
    expected = eq.reference_run(eq.OPTIMIZERS["adam"], data)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def run_job(c, make_model, steps: int, batch=lambda step, rank: (torch.randn(4, 32), None), **options):
    """Train ``steps`` iterations on every worker; return each worker's engine (closed). The schedule is the one
    given (--tune none), whatever the steps: these tests measure one mechanism at a time."""
    options.setdefault("tune", "none")
    models = [make_model() for _ in range(c.num_workers)]

    def body(rank: int):
        model = imerge.distribute(models[rank], OptimizerSpec("sgd", lr=0.01), c.worker_config(rank, **options))
        torch.manual_seed(rank)
        for step in range(steps):
            x, _ = batch(step, rank)
            model(x).square().mean().backward()
        engine = model.engine
        model.close()
        return engine

    return c.run_workers(body)


def equal_layers() -> nn.Module:
    """Eight equal layers, so that every interleave phase carries the same bytes."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])


@pytest.mark.parametrize("period", [2, 4])
def test_interleave_syncs_each_group_at_its_phase(cluster, period):
    steps = 3 * period
    engines = run_job(cluster(2, 2), equal_layers, steps, interleave_period=period)
    for engine in engines:
        pushes = engine.timeline.of("push")
        groups = {i.args["group"] for i in pushes}
        assert groups == set(range(8))
        final = {i.args["group"] for i in pushes if i.args["iteration"] == steps}
        assert final == {g for g in groups if not syncs(g, steps - 1, period)}  # close() syncs the others
        for group in groups:
            iterations = sorted({i.args["iteration"] for i in pushes if i.args["group"] == group
                                 and i.args["iteration"] < steps})  # a push per shard holding some of it
            assert iterations == [k for k in range(steps) if syncs(group, k, period)], f"group {group}"
        total = sum(g.nbytes for g in engine.groups)
        for k in range(steps):
            sent = sum(i.args["bytes"] for i in pushes if i.args["iteration"] == k)
            assert abs(sent - total / period) <= 0.15 * total / period, f"iteration {k}: {sent} of {total}"


def test_interleave_local_steps_between_syncs(cluster):
    """Before close(), a group that synced last iteration agrees across workers and one that stepped locally does
    not; close() syncs the latter, so every worker ends with the same parameters."""
    period, steps, c = 2, 5, cluster(2, 1)
    models = [equal_layers() for _ in range(2)]

    def body(rank: int):
        model = imerge.distribute(models[rank], OptimizerSpec("sgd", lr=0.01), c.worker_config(rank,
                                                                                               interleave_period=2))
        torch.manual_seed(rank)
        for _ in range(steps):
            model(torch.randn(4, 32)).square().mean().backward()
        model.synchronize()
        before = model.engine.flat.values.clone()
        engine = model.engine
        model.close()
        return engine, before, engine.flat.values.clone()

    (engine, before0, after0), (_, before1, after1) = c.run_workers(body)
    for group in engine.groups:
        start, end = group.group.offset, group.group.offset + group.group.numel
        same = torch.equal(before0[start:end], before1[start:end])
        assert same == syncs(group.index, steps - 1, period), f"group {group.index}"
    assert torch.equal(after0, after1)


def overlaps(intervals) -> list:
    ordered = sorted(intervals, key=lambda i: i.start)
    return [(a, b) for a, b in zip(ordered, ordered[1:]) if b.start < a.end]


@pytest.mark.parametrize("slots", ["fixed", "ack"])
def test_slots_serialize_pushes_of_a_group_with_bounded_redis_commands(cluster, redis_url, slots):
    client = redis.Redis.from_url(redis_url)
    before = client.info("commandstats")
    steps, workers = 6, 3
    engines = run_job(cluster(workers, 1), equal_layers, steps, slots=slots)
    after = client.info("commandstats")
    pushes = [i for e in engines for i in e.timeline.of("push")]
    for group in range(8):
        same = [i for i in pushes if i.args["group"] == group]
        assert len(same) == workers * steps
        assert overlaps(same) == [], f"group {group}: pushes overlap"
    waits = [i for e in engines for i in e.timeline.of("flag-wait")]
    assert any(i.args["contended"] for i in waits), "no flag was ever contended: the test shows nothing"
    commands = sum(after.get(f"cmdstat_{c}", {}).get("calls", 0) - before.get(f"cmdstat_{c}", {}).get("calls", 0)
                   for c in ("evalsha", "eval", "blpop"))
    per_worker_iteration = commands / (workers * steps)
    print(f"slots {slots}: {per_worker_iteration:.1f} flag commands per worker per iteration (8 groups)")
    assert per_worker_iteration <= 8 * 6  # acquire + release, plus a bounded number of wake-ups


def test_a_worker_that_leaves_lets_its_answered_pushes_end(cluster, monkeypatch):
    """The last pull can come in before the thread of the push it depended on has handed that push's answer over
    to the comm loop; leaving must not cancel the push's stream then (its timeline entry, its counters, its slot's
    release would be lost)."""
    from imerge.worker.datachannel import SocketDataPath

    push = SocketDataPath._push

    def answered_late(self, *args):
        results = push(self, *args)
        time.sleep(0.2)  # the shard has answered; the answer reaches the comm loop after the pulls' blocks
        return results

    monkeypatch.setattr(SocketDataPath, "_push", answered_late)
    steps, workers = 2, 2
    engines = run_job(cluster(workers, 1), equal_layers, steps)
    pushes = [i for e in engines for i in e.timeline.of("push")]
    for group in range(8):
        assert len([i for i in pushes if i.args["group"] == group]) == workers * steps, f"group {group}"
    assert all(not e.comm.pusher.streams for e in engines)


def most_at_once(spans) -> int:
    """The most (start, end) spans open at one instant (an end before a start at the same instant)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    return max(itertools.accumulate(delta for _, delta in edges))


@pytest.mark.parametrize("width", [1, 2])
def test_port_slots_admit_width_senders_at_once_without_fencing_each_other(cluster, width):
    """Scope shard: every push to the shard's port takes the port's flag; with width k, worker w takes lane
    w mod k, so at most k workers push at once, and lanes' fencing tokens do not fence each other off."""
    workers, steps = 4, 6
    c = cluster(workers, 1)
    engines = run_job(c, equal_layers, steps, slots="ack", slot_scope="shard", slot_width=width)
    pushes = [i for e in engines for i in e.timeline.of("push")]
    streams = {(i.start, i.end) for i in pushes}  # a stream carrying several groups is one interval per group
    at_once = most_at_once(streams)
    assert at_once == width, f"{at_once} pushes into the port at once with width {width}"
    waits = [i for e in engines for i in e.timeline.of("flag-wait")]
    assert any(i.args["contended"] for i in waits), "no flag was ever contended: the test shows nothing"
    assert c.shards[0].shard.counters.fenced_pushes == 0


HOLDER = """
import sys, time
from imerge.control.messages import Flag
from imerge.control.store import Store
store = Store(sys.argv[1], sys.argv[2])
store.acquire_flag(Flag(*map(int, sys.argv[3].split(":"))), "dead-holder", float(sys.argv[4]), 10)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("scope, flag", [("group", "1:0:0"), ("shard", "1:-1:0")])
def test_a_killed_flag_holder_releases_after_its_lease(cluster, scope, flag):
    c = cluster(2, 1)
    lease = 3.0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, c.redis_url, c.job, flag, str(lease)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    held_at = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    engines = run_job(c, equal_layers, 2, slots="ack", slot_scope=scope, slot_width=1, flag_lease_s=lease)
    first_push = min(i.start for e in engines for i in e.timeline.of("push") if i.args["group"] == 0)
    assert first_push >= held_at + lease - 0.5, "group 0 was pushed while the dead holder's lease ran"
    waits = [i for e in engines for i in e.timeline.of("flag-wait") if i.args["group"] == int(flag.split(":")[1])]
    assert any(i.args["contended"] for i in waits)
    assert time.time() - held_at < 60


class TiedUnusedFrozen(nn.Module):
    """A module called twice, a weight tied between two modules, an unused layer, a frozen layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16, bias=False)
        self.shared = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight  # tied (transposed use below)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.embed(x)))))
        h = self.frozen(h)
        return h @ self.head.weight


def test_tied_unused_and_frozen_parameters(cluster):
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=1e-3)
    generator = torch.Generator().manual_seed(3)
    data = [[torch.randn(4, 8, generator=generator) for _ in range(2)] for _ in range(6)]
    c = cluster(2, 2)
    models = [TiedUnusedFrozen() for _ in range(2)]

    def body(rank: int):
        model = imerge.distribute(models[rank], spec, c.worker_config(rank))
        for step in data:
            model(step[rank]).square().mean().backward()
        model.close()
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    results = c.run_workers(body)
    reference = TiedUnusedFrozen()
    optimizer = spec.build([p for p in reference.parameters() if p.requires_grad])
    for step in data:
        grads = []
        for x in step:
            reference.zero_grad()
            reference(x).square().mean().backward()
            grads.append({n: (p.grad.clone() if p.grad is not None else None)
                          for n, p in reference.named_parameters() if p.requires_grad})
        for name, p in reference.named_parameters():
            if p.requires_grad:  # no gradient from any worker: not stepped, as in torch.optim
                given = [g[name] if g[name] is not None else torch.zeros_like(p) for g in grads]
                p.grad = None if all(g[name] is None for g in grads) else (given[0] + given[1]) / 2
        optimizer.step()
    initial = dict(TiedUnusedFrozen().named_parameters())
    for params in results:
        for name, value in reference.named_parameters():
            torch.testing.assert_close(params[name], value.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert torch.equal(params["frozen.weight"], initial["frozen.weight"])
        assert torch.equal(params["unused.weight"], initial["unused.weight"])  # no gradient: no weight decay either
