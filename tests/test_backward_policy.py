"""The training thread's policy per backward (imerge.core.backward): its rules, and the worker and the simulator
deciding alike.

The unit tests pin the kernel's rules (waits, local steps, overlap, the naive PS, no_sync, groups without a
gradient, the profiled iterations). The cluster test runs a real job (the worker's autograd hooks), records what
its kernel decided, replays the events through the kernel the simulator builds for the same job and the
simulator's events through the worker's, and checks that both queued and stepped the same groups in each
iteration.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import imerge
from helpers import simulated_like, trained
from imerge.core.backward import BackwardPolicy, Enqueue, LocalStep, Unfinished, WaitAll, WaitPushed, replay
from imerge.core.optim import OptimizerSpec
from imerge.core.schedule import SyncSchedule


def policy(groups: int = 3, overlap: bool = True, period: int = 1, trace: list | None = None) -> BackwardPolicy:
    return BackwardPolicy(groups, overlap, SyncSchedule(period), trace)


def test_with_overlap_a_complete_group_is_queued_at_once_after_its_previous_push():
    kernel = policy()
    kernel.started(0)
    assert kernel.gradient(0) == [WaitPushed(0)]
    assert kernel.complete(0) == [Enqueue(0)]
    assert kernel.gradient(2) == [WaitPushed(2)] and kernel.complete(2) == [Enqueue(2)]
    assert kernel.ended() == [Unfinished(1), Enqueue(1)]  # no gradient: zeros, pushed all the same


def test_between_syncs_a_group_steps_locally_and_is_not_queued():
    kernel = policy(groups=2, period=2)
    for iteration in range(3):
        kernel.started(iteration)
        actions = [kernel.gradient(g) + kernel.complete(g) for g in range(2)]
        syncing = iteration % 2  # group g's phase is (-g) mod 2: group 0 syncs in even iterations
        assert actions[syncing] == [WaitPushed(syncing), Enqueue(syncing)]
        assert actions[1 - syncing] == [WaitPushed(1 - syncing), LocalStep(1 - syncing)]
        assert kernel.ended() == []


def test_the_naive_ps_queues_every_sync_after_backward_and_waits_for_them():
    kernel = policy(groups=3, overlap=False, period=3)
    kernel.started(1)
    for group in range(3):
        kernel.gradient(group)
        assert kernel.complete(group) == []
    assert kernel.ended() == [Enqueue(2), WaitAll()]


def test_no_sync_only_waits_for_the_previous_push_and_fusion_cost_profiling_syncs_every_group():
    kernel = policy(groups=2, period=2)
    kernel.started(1, accumulate=True)
    assert kernel.gradient(1) == [WaitPushed(1)] and kernel.complete(1) == [] and kernel.ended() == []
    kernel.profiling(True)
    kernel.started(1)
    assert kernel.gradient(0) == [WaitPushed(0)] and kernel.complete(0) == [Enqueue(0)]
    kernel.regrouped(1)
    kernel.restart(2, 2)
    kernel.started(3)  # counted from 2: iteration 1 of the new schedule, group 0 steps locally
    assert kernel.gradient(0) == [WaitPushed(0), LocalStep(0)]
    assert kernel.complete(0) == [] and kernel.ended() == []


def test_a_trace_replayed_through_a_fresh_kernel_decides_alike_and_a_kernel_made_otherwise_does_not():
    trace: list = []
    kernel = policy(groups=2, period=2, trace=trace)
    for iteration in range(3):
        kernel.started(iteration)
        kernel.gradient(1)
        kernel.complete(1)
        kernel.ended()
    assert replay(trace, kernel) == trace
    assert replay(trace, policy(groups=2, period=1)) != trace
    assert replay(trace, policy(groups=2, overlap=False, period=2)) != trace


# -- the worker and the simulator -----------------------------------------------------------------------------
def layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)], nn.Linear(128, 10))


SCHEDULES = {
    "T = 2": dict(interleave_period=2),   # local steps between syncs
    "naive": dict(overlap=False),         # every sync after backward, then waited for
}


def decisions(trace: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each backward's groups queued and groups stepped locally (each once, sorted)."""
    result: list[tuple[set[int], set[int]]] = []
    for event in trace:
        if event["event"] == "started":
            result.append((set(), set()))
        for kind, *args in event.get("actions", []):
            if kind in ("Enqueue", "LocalStep"):
                result[-1][kind == "LocalStep"].add(args[0])
    return [(sorted(queued), sorted(stepped)) for queued, stepped in result]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_simulator_s_backward_decides_as_the_worker_s(cluster, schedule):
    c = cluster(2, 2)
    options = dict(SCHEDULES[schedule], fusion="size", size_cap_mib=0.15, first_cap_mib=0.05, tune="none")
    iterations = 4

    def body(rank: int):
        model = imerge.distribute(layers(), OptimizerSpec("sgd", lr=0.01), c.worker_config(rank, **options))
        kernel = model.engine.state.policy
        trace: list[dict] = []
        kernel.record(trace)
        return (trace, kernel, *trained(model, rank, iterations, 128))

    for trace, kernel, plan, config in c.run_workers(body):
        job = simulated_like(plan, config, iterations, traced=True)
        assert len(job.first_plan.groups) == len(plan.groups) > 2
        job.run()
        simulated = job.workers[0]  # no flags: every worker is one class
        assert replay(trace, simulated.policy) == trace, "the worker's backward through the simulator's kernel"
        assert job.backward_traces is not None
        sim_trace = job.backward_traces[simulated.index]
        assert replay(sim_trace, kernel) == sim_trace, "the simulator's backward through the worker's kernel"
        assert decisions(trace) == decisions(sim_trace)
        queued = [q for q, _ in decisions(trace)]
        if schedule == "T = 2":
            assert all(q and stepped for q, stepped in decisions(trace)) and queued[0] != queued[1]
        else:
            assert all(e["actions"][-1] == ["WaitAll"] for e in trace if e["event"] == "ended")
