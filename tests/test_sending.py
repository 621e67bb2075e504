"""The sending kernel (imerge.core.sending): its decisions, and the worker and the simulator making the same ones.

The unit tests pin the kernel's rules (byte credit, streams in flight, priority, rotation). The cluster test runs a
real job (real shards, real Redis, the worker's comm thread), records the decisions its kernel made, and feeds the
recorded events through the kernel that the simulator builds for the same job: the same streams, in the same order,
carrying the same blocks.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import imerge
from helpers import simulated_like
from imerge.core.optim import OptimizerSpec
from imerge.core.sending import PUSHES_IN_FLIGHT, SEND_CREDIT, SendPolicy, Senders, replay

MIB = 1 << 20


def kernel(priority: bool = True, holds_flags: bool = False, scope: str = "group", rank: int = 0,
           trace: list | None = None) -> Senders[str, tuple[int, int]]:
    """Blocks are (offset, bytes) pairs; syncs are names."""
    return Senders(SendPolicy(priority, holds_flags, scope, rank), size_of=lambda b: b[1], offset_of=lambda b: b[0],
                   dropped=lambda tag: tag.startswith("failed"), trace=trace)


def carried(stream) -> list[tuple[str, int]]:
    return [(tag, block[0]) for tag, block in stream.items]


def test_a_stream_carries_queued_blocks_up_to_the_credit_and_the_next_starts_once_it_is_written():
    senders = kernel()
    blocks = [(i, MIB) for i in range(10)]
    [first] = senders.submit(0, "g0", {0: blocks})
    assert len(first.items) == SEND_CREDIT // MIB  # 4 MiB: the credit is reached with the 4th block
    assert senders.submit(1, "g1", {0: [(100, MIB)]}) == []  # the shard's stream is still being written
    [second] = senders.written(first)
    # the higher group (the next forward needs it first) goes first, then group 0's, highest offset first
    assert carried(second) == [("g1", 100), ("g0", 5), ("g0", 4), ("g0", 3)]
    assert senders.written(second) == []  # two streams unanswered: the third waits for a reply
    [third] = senders.answered(first)
    assert [b for _, b in carried(third)] == [2, 1, 0]
    assert PUSHES_IN_FLIGHT == 2


def test_without_priority_the_blocks_go_in_the_order_they_were_queued():
    senders = kernel(priority=False)
    [first] = senders.submit(0, "g0", {0: [(0, 3 * MIB), (5, 3 * MIB)]})
    assert senders.written(first) == []  # nothing queued
    [second] = senders.submit(3, "g3", {0: [(9, MIB)]})
    assert [b for _, b in carried(first)] == [0, 5]
    assert carried(second) == [("g3", 9)]


def test_each_shard_has_its_own_stream_and_a_failed_sync_s_blocks_are_dropped():
    senders = kernel()
    streams = senders.submit(0, "failed g0", {0: [(0, MIB)], 1: [(1, MIB)]})
    assert streams == []
    streams = senders.submit(1, "g1", {0: [(2, MIB)], 1: [(3, MIB)]})
    assert sorted((s.shard, carried(s)) for s in streams) == [(0, [("g1", 2)]), (1, [("g1", 3)])]


def test_with_flags_one_stream_is_in_flight_and_a_group_goes_whole_shard_after_shard_from_the_rank():
    port = kernel(holds_flags=True, scope="shard")
    [first] = port.submit(0, "g0", {0: [(i, 3 * MIB) for i in range(3)]})
    assert port.written(first) == []  # its flag is held until the reply
    assert len(port.answered(first)[0].items) == 1
    for rank, expected in [(0, [0, 1, 2]), (1, [1, 2, 0]), (5, [2, 0, 1])]:
        group = kernel(holds_flags=True, rank=rank)
        assert group.policy.per_group
        streams = group.group_pushes(4, "g4", {2: [(20, MIB)], 0: [(0, MIB), (5, MIB)], 1: [(10, MIB)]})
        assert [s.shard for s in streams] == expected
        assert carried(next(s for s in streams if s.shard == 0)) == [("g4", 5), ("g4", 0)]


def test_a_trace_replayed_through_a_fresh_kernel_gives_the_same_decisions():
    recorded: list = []
    senders = kernel(trace=recorded)
    pending = senders.submit(0, "g0", {0: [(i, MIB) for i in range(9)], 1: [(50, 2 * MIB)]})
    pending += senders.submit(2, "g2", {0: [(70, 3 * MIB)]})
    while pending:
        stream = pending.pop(0)
        pending += senders.written(stream) + senders.answered(stream)
    assert len(recorded) > 6
    assert replay(recorded, senders, lambda offset: (offset, 2 * MIB if offset == 50 else
                                                   3 * MIB if offset == 70 else MIB)) == recorded
    # a kernel whose sizes or policy differ decides otherwise: the comparison can fail
    assert replay(recorded, senders, lambda offset: (offset, 4 * MIB)) != recorded
    assert replay(recorded, kernel(priority=False), lambda offset: (offset, MIB)) != recorded


# -- the worker and the simulator -----------------------------------------------------------------------------
def layers() -> nn.Module:
    """Layers of 4 MiB in groups of two, split into 10 blocks each: a group's share of a shard is about the send
    credit, so how many blocks a stream carries depends on their wire bytes."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)], nn.Linear(1024, 10))


SCHEDULES = {  # the worker options; each a different path through the kernel
    "priority": dict(priority=True, slots="off"),
    "fifo": dict(priority=False, slots="off"),
    "fp16": dict(priority=True, slots="off", compression="fp16"),  # half the bytes: more blocks per stream
    "port flags": dict(priority=True, slots="ack", slot_scope="shard", slot_width=1),
    "group flags": dict(priority=True, slots="ack", slot_scope="group"),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_simulator_makes_the_decisions_the_worker_made(cluster, schedule):
    c = cluster(2, 2)
    options = dict(SCHEDULES[schedule], fusion="size", size_cap_mib=8.5, first_cap_mib=0.5, partition_mib=0.5)

    def body(rank: int):
        model = imerge.distribute(layers(), OptimizerSpec("sgd", lr=0.01), c.worker_config(rank, **options))
        senders = model.engine.comm.pusher.senders
        senders.trace = []
        torch.manual_seed(rank)
        for _ in range(3):
            model(torch.randn(4, 1024)).square().mean().backward()
        model.synchronize()
        plan, config = model.engine.plan, model.engine.config
        model.close()
        return senders.trace, plan, config

    for rank, (trace, plan, config) in enumerate(c.run_workers(body)):
        assert any(len(event["streams"]) for event in trace)
        streams = [s for event in trace for s in event["streams"]]
        assert max(len(blocks) for _, _, blocks in streams) > 1  # batches of several blocks
        if schedule != "group flags":
            assert any(e["event"] in ("written", "answered") and e["streams"] for e in trace)

        job = simulated_like(plan, config, 3)
        assert [(b.offset, b.numel, b.shard) for b in job.first_plan.blocks] == \
            [(b.offset, b.numel, b.shard) for b in plan.blocks]
        index_at = {b.offset: i for i, b in enumerate(job.first_plan.blocks)}
        # without flags every worker is one class; with them each position in a lane is one (here: each rank)
        worker = job.workers[0] if job.policy == "off" else next(w for w in job.workers if w.rank == rank)
        assert replay(trace, job.senders_for(worker), index_at.__getitem__) == trace, f"worker {rank}: the decisions differ"
