"""A block's round (imerge.core.blockround): its rules, and the shard and the simulator driving it alike.

The unit tests pin the kernel's rules (counting, retries, fences, options, completion, failure, restores). The
cluster tests record what a real shard's blocks decided (a real job; a shard answering bad pushes over gRPC) and
replay the events through the kernel the simulator builds for the same job, and the simulator's through the
shard's: the same actions, in the same order.
"""
from __future__ import annotations


import math
import time

import grpc
import numpy as np
import pytest
import torch
from torch import nn

import imerge
from helpers import simulated_like, trained
from imerge.core.blockround import (Aggregate, Agree, BlockRound, Counted, Fail, Publish, Receive, Retry, Step,
                                    Supersede, replay)
from imerge.core.errors import FailedPrecondition, Fenced, InvalidArgument, StaleGeneration, Unavailable
from imerge.core.optim import OptimizerSpec
from imerge.core.rounds import Push, RoundOptions
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc


def push(worker: int, round_: int = 0, **fields) -> Push:
    return Push("b", worker, round_, "float32", 10, **fields)


def counted_push(machine: BlockRound, p: Push, source: str = "", alike: int = 1) -> list:
    assert isinstance(machine.offer(p, alike), Receive)
    machine.receive_started(p, alike)
    return machine.counted(p, source, alike)


def test_the_last_push_starts_the_aggregation_and_its_completion_publishes_the_next_round():
    machine = BlockRound("b", 3)
    assert counted_push(machine, push(0, no_grad=(1, 2))) == [Counted(0, 1)]
    assert machine.pulled(0, 0) is None and machine.missing() == [1, 2]
    assert counted_push(machine, push(2, no_grad=(2,))) == [Counted(2, 2)]
    assert counted_push(machine, push(1, no_grad=(0, 2))) == [Counted(1, 3), Aggregate(0, RoundOptions(), (2,))]
    assert machine.completed(0) == [Publish(1, (False, 0.0))]
    assert machine.round == 1 and machine.pulled(0, 0) == (1, (False, 0.0)) and machine.pushed == set()
    with pytest.raises(FailedPrecondition, match="round 1 is not being aggregated"):
        machine.completed(1)
    with pytest.raises(FailedPrecondition, match="current round is 1"):
        machine.check_pull(0, 3)


def test_a_round_that_clips_steps_with_the_job_s_totals_and_publishes_their_norm():
    machine = BlockRound("b", 1)
    clipped = RoundOptions(max_norm=1.0)
    assert counted_push(machine, push(0, options=clipped))[-1] == Aggregate(0, clipped, ())
    with pytest.raises(FailedPrecondition, match="before the job agreed"):
        machine.completed(0)
    with pytest.raises(FailedPrecondition, match="before its own scalars"):
        machine.agreed(0, 25.0, False)
    assert machine.averaged(0, 9.0, False) == Agree(0, (9.0, False))
    assert machine.agreed(0, 25.0, False) == Step(0, (25.0, False))  # the other blocks' squares too
    assert machine.completed(0) == [Publish(1, (False, 5.0))]
    counted_push(machine, push(0, round_=1, options=RoundOptions(loss_scale=8.0)))
    machine.averaged(1, 0.0, True)
    assert machine.agreed(1, 4.0, True) == Step(1, (4.0, True))  # an inf anywhere: every block skips
    assert machine.completed(1) == [Publish(2, (True, math.inf))]
    counted_push(machine, push(0, round_=2))
    with pytest.raises(FailedPrecondition, match="needs no agreement"):
        machine.averaged(2, 1.0, False)


def test_a_counted_row_pushed_again_is_a_retry_and_another_round_is_refused():
    machine = BlockRound("b", 2)
    counted_push(machine, push(0), source="10.0.0.1")
    assert machine.offer(push(0)) == Retry(0, 0, "10.0.0.1")
    with pytest.raises(FailedPrecondition, match="current round is 0"):
        machine.offer(push(1, round_=1))
    counted_push(machine, push(1))
    machine.completed(0)
    assert machine.offer(push(1, round_=0)) == Retry(1, 0, "")  # the round before: a retry of a late reply
    machine.receive_started(push(1, round_=1))  # the row is overwritten: it no longer holds round 0
    assert machine.offer(push(1, round_=0)) == Retry(1, -1, "")


def test_a_token_older_than_one_seen_in_its_lane_is_fenced_and_only_a_counted_push_moves_the_fence():
    machine = BlockRound("b", 3)
    assert machine.offer(push(0, fence=5, lane=1)) == Receive(0, True)
    machine.receive_started(push(0, fence=5, lane=1))
    machine.abandoned(push(0, fence=5, lane=1))  # not counted: the fence stays
    assert machine.offer(push(1, fence=4, lane=1)) == Receive(1, True) and machine.busy() == []
    counted_push(machine, push(1, fence=4, lane=1))
    with pytest.raises(Fenced, match="token 3 is older than token 4 already seen in lane 1"):
        machine.offer(push(2, fence=3, lane=1))
    assert machine.offer(push(2, fence=3, lane=0)) == Receive(2, True)  # another lane
    assert machine.offer(push(2, fence=4, lane=1)) == Receive(2, False)


def test_options_that_differ_from_the_round_s_are_refused_before_and_after_the_payload():
    machine = BlockRound("b", 3)
    scaled = RoundOptions(loss_scale=1024.0)
    counted_push(machine, push(0, options=scaled))
    with pytest.raises(FailedPrecondition, match="grad scalers or clipping disagree"):
        machine.offer(push(1))
    with pytest.raises(InvalidArgument, match="loss_scale -1"):
        machine.offer(push(1, options=RoundOptions(loss_scale=-1.0)))
    # two pushes admitted before either counted: the second to count is refused after its payload
    fresh = BlockRound("b", 3)
    for p in (push(0, options=scaled), push(1)):
        fresh.offer(p)
        fresh.receive_started(p)
    fresh.counted(push(0, options=scaled))
    with pytest.raises(FailedPrecondition, match="disagree"):
        fresh.counted(push(1))
    assert fresh.busy() == [0] and fresh.pushed == {0}


def test_a_failed_round_fails_its_pulls_and_a_restore_makes_them_stale():
    machine = BlockRound("b", 1)
    assert counted_push(machine, push(0))[-1] == Aggregate(0, RoundOptions(), ())
    assert machine.failed(0, "round 0 could not complete: boom") == [Fail(0, "round 0 could not complete: boom")]
    with pytest.raises(Unavailable, match="pull of block b by worker 0 for round 0: round 0 could not complete"):
        machine.pulled(0, 0)
    assert machine.supersede(3) == [Supersede(3)]
    with pytest.raises(StaleGeneration, match="generation 3"):
        machine.pulled(0, 0)


def test_a_push_may_stand_for_a_class_of_workers_alike():
    machine = BlockRound("b", 5)
    assert counted_push(machine, push(0), alike=4) == [Counted(0, 4)]
    assert machine.missing() == [4]
    with pytest.raises(InvalidArgument, match="workers 3..5 outside 0..4"):
        machine.receive_started(push(3), alike=3)
    with pytest.raises(InvalidArgument, match="workers 7..7 outside 0..4"):
        machine.offer(push(7))
    assert counted_push(machine, push(4))[-1] == Aggregate(0, RoundOptions(), ())


def test_a_trace_replayed_through_a_fresh_kernel_gives_the_same_actions_and_refusals():
    trace: list = []
    machine = BlockRound("b", 2, round_=7, trace=trace)
    counted_push(machine, push(0, round_=7, fence=2))
    machine.offer(push(0, round_=7))
    with pytest.raises(Fenced):
        machine.offer(push(1, round_=7, fence=1))
    counted_push(machine, push(1, round_=7, fence=3))
    machine.completed(7)
    assert [e["event"] for e in trace] == ["start", "offer", "receive_started", "counted", "offer", "offer", "offer",
                                           "receive_started", "counted", "completed"]
    assert trace[5]["refused"][0] == "Fenced"
    assert replay(trace, machine) == trace
    assert replay(trace, BlockRound("b", 3)) != trace  # a kernel made otherwise decides otherwise


# -- a real shard and the simulator ----------------------------------------------------------------------------
def layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)], nn.Linear(256, 10))


SCHEDULES = {
    "priority": dict(priority=True, slots="off"),
    "port flags": dict(priority=True, slots="ack", slot_scope="shard", slot_width=1),  # fencing tokens
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_simulator_s_blocks_decide_as_the_shard_s_did(cluster, schedule):
    c = cluster(2, 2)
    traces: list[dict] = []
    for threaded in c.shards:
        threaded.server.shard.round_traces = {}
        traces.append(threaded.server.shard.round_traces)
    options = dict(SCHEDULES[schedule], fusion="size", size_cap_mib=0.3, first_cap_mib=0.1, partition_mib=0.1)
    iterations = 3

    def body(rank: int):
        model = imerge.distribute(layers(), OptimizerSpec("sgd", lr=0.01), c.worker_config(rank, **options))
        return trained(model, rank, iterations, 256)

    plan, config = c.run_workers(body)[0]
    job = simulated_like(plan, config, iterations, max_shard_classes=2, traced=True)
    job.run()
    assert job.round_traces is not None and len(job.round_traces) == len(plan.blocks) > 2
    for index, block in enumerate(plan.blocks):
        shard_trace = traces[block.shard][block.block_id]
        shard_class = job.shard_classes[job.class_of_shard[block.shard]]
        assert any(e.get("push", {}).get("fence") for e in shard_trace) == (schedule == "port flags")
        # the shard's events through the simulator's kernel of the block, and the simulator's through the shard's
        assert replay(shard_trace, job.block_round(shard_class, index)) == shard_trace, block.block_id
        sim_trace = job.round_traces[index]
        shard_block = c.shards[block.shard].server.shard.blocks[block.block_id]
        assert replay(sim_trace, shard_block.rounds) == sim_trace, block.block_id
        # and both drove the same rounds to the same decisions
        assert completions(sim_trace) == completions(shard_trace)
        assert [(a["action"], a["round"]) for a in completions(shard_trace)] == \
            [(kind, r + (kind == "Publish")) for r in range(iterations) for kind in ("Aggregate", "Publish")]


def completions(trace: list[dict]) -> list[dict]:
    """The aggregations started and the rounds published, in order."""
    return [a for e in trace for a in e.get("actions", []) if a["action"] in ("Aggregate", "Publish")]


@pytest.fixture
def shard(redis_url):
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="blockround", register=False, pull_timeout_s=1.0))
    server.server.shard.round_traces = {}
    yield server
    server.stop()


def test_a_shard_s_retries_and_refusals_replay_through_the_kernel(shard):
    """Bad and repeated pushes over gRPC: the shard's kernel decided each (a duplicate, another round, options that
    disagree, a push that counts), and a fresh kernel decides them alike."""
    numel, sgd = 16, ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}')
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        spec = ps_pb2.BlockSpec(block_id="b", dtype=ps_pb2.FLOAT32, numel=numel, num_workers=2, optimizer=sgd)
        stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                             ps_pb2.InitBlockChunk(data=np.zeros(numel, "<f4").tobytes())]))

        def send(worker: int, round_: int = 0, **header) -> str:
            messages = [ps_pb2.PushChunk(header=ps_pb2.PushHeader(block_id="b", worker=worker, round=round_,
                                                                  dtype=ps_pb2.FLOAT32, numel=numel, **header)),
                        ps_pb2.PushChunk(data=np.ones(numel, "<f4").tobytes())]
            try:
                stub.Push(iter(messages), timeout=10)
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name

        assert [send(0), send(0), send(1, round_=3), send(1, max_norm=1.0), send(1)] == \
            ["OK", "OK", "FAILED_PRECONDITION", "FAILED_PRECONDITION", "OK"]
        list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=0, timeout_s=5), timeout=10))
        assert [send(0, round_=1, max_norm=1.0), send(1, round_=1, max_norm=1.0)] == ["OK", "OK"]  # clipped
        list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=0, round=1, timeout_s=5), timeout=10))
    trace = shard.server.shard.round_traces["b"]
    assert [(e["event"], [a["action"] for a in e.get("actions", [])], e.get("refused", [""])[0]) for e in trace] == [
        ("start", [], ""),
        ("offer", ["Receive"], ""), ("receive_started", [], ""), ("counted", ["Counted"], ""),
        ("offer", ["Retry"], ""),
        ("offer", [], "FailedPrecondition"),
        ("offer", [], "FailedPrecondition"),
        ("offer", ["Receive"], ""), ("receive_started", [], ""), ("counted", ["Counted", "Aggregate"], ""),
        ("completed", ["Publish"], ""),
        *[("offer", ["Receive"], ""), ("receive_started", [], ""), ("counted", ["Counted"], "")],
        ("offer", ["Receive"], ""), ("receive_started", [], ""), ("counted", ["Counted", "Aggregate"], ""),
        ("averaged", ["Agree"], ""), ("agreed", ["Step"], ""), ("completed", ["Publish"], "")]
    assert trace[-1]["actions"][0]["result"] == [False, pytest.approx(4.0)]  # the norm of a mean of ones: sqrt(16)
    assert replay(trace, shard.server.shard.blocks["b"].rounds) == trace
    assert replay(trace, BlockRound("b", 3)) != trace


def test_a_stopping_shard_ends_the_rounds_still_waiting_for_the_agreement(redis_url):
    """A clipped round waits for every block's scalars; a shard stopped meanwhile ends that wait (its task is
    cancelled and awaited) instead of leaving a task that the closing loop destroys while it is pending."""
    server = ThreadedShard(PSConfig(redis_url=redis_url, job="endrounds", register=False))
    numel, sgd = 16, ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}')
    with grpc.insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for block_id in ("a", "b"):
            spec = ps_pb2.BlockSpec(block_id=block_id, dtype=ps_pb2.FLOAT32, numel=numel, num_workers=1,
                                    optimizer=sgd)
            stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                                 ps_pb2.InitBlockChunk(data=np.zeros(numel, "<f4").tobytes())]), timeout=10)
        header = ps_pb2.PushHeader(block_id="a", worker=0, round=0, dtype=ps_pb2.FLOAT32, numel=numel, max_norm=1.0)
        stub.Push(iter([ps_pb2.PushChunk(header=header), ps_pb2.PushChunk(data=np.ones(numel, "<f4").tobytes())]),
                  timeout=10)  # block a averaged; the round waits for block b's scalars, which never come
    deadline = time.monotonic() + 10
    while not server.shard._tasks:
        assert time.monotonic() < deadline, "the clipped round never started"
        time.sleep(0.02)
    server.stop()
    assert not server.shard._tasks
