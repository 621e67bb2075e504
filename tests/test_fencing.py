"""Generations and fencing tokens: nothing of an older generation or of a late flag holder is applied."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

import grpc
import pytest
import torch

import imerge
from imerge.control.messages import FailureReport, Flag
from imerge.control.store import Store
from imerge.core.errors import StaleGeneration
from imerge.core.optim import OptimizerSpec
from imerge.workloads.models import build_model
from imerge.ps.checkpoint import CheckpointStore
from imerge.wire.rpc import ps_pb2, ps_pb2_grpc
from imerge.ops.top import scrape
from imerge.worker.transport import ShardClient

from helpers import raw_push as push

HOLDER = """
import sys
from imerge.control.messages import Flag
from imerge.control.store import Store
sys.path.insert(0, sys.argv[7])
from helpers import raw_push as push
url, job, flag, address, block_id, numel = sys.argv[1:7]
fence = Store(url, job).acquire_flag(Flag(*map(int, flag.split(":"))), "holder", lease_s=1.0, timeout_s=10,
                                     generation=0).fence
print(fence, flush=True)
sys.stdin.readline()  # SIGSTOPped here, past its lease
code, details = push(address, block_id, int(numel), 0, 0, 0, fence)
print(code, details, flush=True)
"""


def joined_cluster(cluster, tmp_path, **options):
    """Two workers joined (blocks initialized, round 0), then left; the shard checkpoints every round."""
    c = cluster(2, 1, ps_options={"checkpoint_dir": str(tmp_path), "checkpoint_every": 1})
    models = c.run_workers(lambda rank: imerge.distribute(
        build_model("digits-cnn"), OptimizerSpec("sgd", lr=0.01), c.worker_config(rank, heartbeat_ttl_s=120, **options)))
    plan = models[0].plan
    for model in models:
        model.abort()
    return c, plan.blocks[0]


def stats(address: str) -> ps_pb2.StatsReply:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).Stats(ps_pb2.StatsRequest(), timeout=5)


def counter(address: str, name: str) -> float:
    return scrape(address, 5)[(name, (("shard", "0"),))]


@pytest.mark.timeout(120)
def test_a_recovery_fails_waiting_pulls_and_rejects_the_old_generation(cluster, tmp_path):
    c, block = joined_cluster(cluster, tmp_path)
    address, metrics = c.addresses[0], f"127.0.0.1:{c.shards[0].server.metrics.port}"
    assert push(address, block.block_id, block.numel, 0, 0, 0, 0) == ("OK", "")
    outcome = {}

    def pull():
        request = ps_pb2.PullRequest(block_ids=[block.block_id], worker=0, round=0, timeout_s=30, generation=0)
        with grpc.insecure_channel(address) as channel:
            try:
                list(ps_pb2_grpc.ParameterServerStub(channel).Pull(request, timeout=40))
            except grpc.RpcError as exc:
                outcome["error"] = (exc.code(), exc.details())

    def pull_on_the_channel():  # the data channel's pull waits the same way and fails the same way
        async def run():
            client = ShardClient(address, data_path="socket")
            try:
                await client.pull_into([(block.block_id, torch.empty(block.numel))], 0, 0, 30)
            except StaleGeneration as exc:
                outcome["channel"] = str(exc)
            finally:
                await client.close()

        asyncio.run(run())

    waiting, on_channel = threading.Thread(target=pull), threading.Thread(target=pull_on_the_channel)
    waiting.start()
    on_channel.start()
    time.sleep(0.5)  # the pulls wait for worker 1
    store = Store(c.redis_url, c.job)
    store.report_failure(FailureReport(0, "worker 1", "simulated"))
    store.wait_restored(1, 0, 30)
    run = store.generation_event(0).run
    assert CheckpointStore(tmp_path, shard=0, run=run).rounds() == [0]  # stamped with this run of the job
    waiting.join(30)
    on_channel.join(30)
    code, details = outcome["error"]
    assert code == grpc.StatusCode.ABORTED and "moved to generation 1" in details
    assert "moved to generation 1" in outcome["channel"]
    assert push(address, block.block_id, block.numel, 1, 0, 0, 0) == (
        "ABORTED", f"push of block {block.block_id} by worker 1 for round 0: generation 0 is stale; "
                               "the job is at generation 1 (it recovered from a checkpoint): rejoin")
    assert counter(metrics, "imerge_shard_stale_generation_requests_total") == 3
    assert push(address, block.block_id, block.numel, 1, 0, 1, 0) == ("OK", "")
    restored = {b.block_id: b for b in stats(address).blocks}[block.block_id]
    assert restored.round == 0 and restored.pushed == 1  # worker 0's push of generation 0 is gone
    assert push(address, block.block_id, block.numel, 0, 0, 2, 0)[0] == "UNAVAILABLE"  # not restored yet


@pytest.mark.timeout(120)
def test_sigstopped_flag_holder_is_fenced_off_after_its_lease(cluster, tmp_path):
    c, block = joined_cluster(cluster, tmp_path, slots="ack")
    address, metrics = c.addresses[0], f"127.0.0.1:{c.shards[0].server.metrics.port}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, c.redis_url, c.job, "1:0:0", address, block.block_id,
                               str(block.numel), str(Path(__file__).parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        old_fence = int(holder.stdout.readline())
        os.kill(holder.pid, signal.SIGSTOP)
        grant = Store(c.redis_url, c.job).acquire_flag(Flag(1, 0, 0), "w1", lease_s=10, timeout_s=10)
        new_fence = grant.fence
        assert grant.contended and new_fence > old_fence  # granted once the stopped holder's lease expired
        assert push(address, block.block_id, block.numel, 1, 0, 0, new_fence) == ("OK", "")
        os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.write("push\n")
        holder.stdin.flush()
        late = holder.stdout.readline()
        assert late.startswith("ABORTED") and f"token {old_fence} is older than token {new_fence}" in late
        assert counter(metrics, "imerge_shard_fenced_pushes_total") == 1
        current = {b.block_id: b for b in stats(address).blocks}[block.block_id]
        assert current.pushed == 1 and current.round == 0  # the late push was not applied
        retry_fence = Store(c.redis_url, c.job).acquire_flag(Flag(1, 0, 0), "w0-again", lease_s=10, timeout_s=15).fence
        assert push(address, block.block_id, block.numel, 0, 0, 0, retry_fence) == ("OK", "")
        deadline = time.monotonic() + 10
        while {b.block_id: b for b in stats(address).blocks}[block.block_id].round != 1:  # the round completes
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        holder.kill()
        holder.wait(10)
