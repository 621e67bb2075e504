"""Failures end in a clear error within their timeout, never in a hang."""
from __future__ import annotations

import asyncio
import dataclasses

import threading
import time

import pytest
import torch

import imerge
from imerge.control.store import Store
from imerge.control.messages import Flag
from imerge.core.errors import DeadlineExceeded, FailedPrecondition, LayoutMismatchError, StoreError, WaitTimeout
from imerge.workloads.models import build_model

from helpers import new_job

SGD = imerge.OptimizerSpec("sgd", lr=0.01)  # given: the job is joined in imerge.distribute


X, Y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))  # one batch of digits


def joined_workers(c, pull_timeout_s: float):
    """``join(rank)``: rank's digits CNN wrapped for cluster ``c``, once every worker has joined."""
    models = [build_model("digits-cnn") for _ in range(c.num_workers)]
    barrier = threading.Barrier(c.num_workers)

    def join(rank: int):
        model = imerge.distribute(models[rank], SGD, c.worker_config(rank, pull_timeout_s=pull_timeout_s))
        barrier.wait(30)
        return model

    return join


def test_worker_that_never_pushes_fails_the_others_within_the_timeout(cluster):
    c = cluster(3, 2)
    join, x, y = joined_workers(c, 2.0), X, Y

    def body(rank: int):
        model = join(rank)
        try:
            if rank == 2:  # joins, then never pushes
                time.sleep(4)
                return None
            torch.nn.functional.cross_entropy(model(x), y).backward()
            started = time.monotonic()
            with pytest.raises((DeadlineExceeded, FailedPrecondition)) as info:
                model(x)  # the forward waits for the pulls, which time out
            return time.monotonic() - started, info.value
        finally:
            model.abort()

    results = c.run_workers(body)
    for waited, error in results[:2]:
        assert "workers [2] have not pushed" in str(error)
        # its own pull's timeout, or, where a peer's came first and the job failed for good (no checkpoint to
        # recover from), the shard's word that the job failed, naming the same cause
        assert (error.status == "DEADLINE_EXCEEDED" and error.recoverable) or \
            (error.status == "FAILED_PRECONDITION" and "the job failed" in str(error)), error
        assert waited < 2.0 + 3.0


def test_abort_from_another_thread_ends_a_forward_waiting_for_its_pull_at_once(cluster):
    """A watchdog's (or a signal handler thread's) ``abort()`` while the training thread's forward waits for a
    pull that cannot complete (the other worker never pushes): the forward raises at once, saying the worker
    left the job, instead of waiting out its 80 s wait timeout."""
    from imerge.core.errors import Cancelled

    c = cluster(2, 1)
    join, x, y = joined_workers(c, 30.0), X, Y

    def body(rank: int):
        model = join(rank)
        if rank == 1:  # joins, never pushes, and leaves once the other has seen its abort
            time.sleep(6)
            model.abort()
            return None
        torch.nn.functional.cross_entropy(model(x), y).backward()
        aborted: list[float] = []
        watchdog = threading.Timer(1.0, lambda: (aborted.append(time.monotonic()), model.abort()))
        watchdog.start()
        with pytest.raises(Cancelled, match="the worker left the job") as info:
            model(x)  # waits for the pulls of round 0
        ended = time.monotonic()
        watchdog.join(10)
        return ended - aborted[0], info.value

    waited, error = c.run_workers(body)[0]
    assert waited < 3.0, (waited, error)


@pytest.mark.parametrize("broken", ["consumer", "sender"])
def test_a_bug_on_the_comm_thread_fails_the_iteration_at_once_naming_it(lone, monkeypatch, broken):
    """An exception the comm thread's own loops do not expect (a bug, not a failed RPC) fails every sync waiting
    on it at once, naming it, as a fatal error; the training thread does not sit out its wait timeout."""
    from imerge.core.errors import IMergeError
    from imerge.worker import comm, pushes

    def bug(*_args, **_kwargs):
        raise RuntimeError("an unexpected bug")

    model = lone(build_model("digits-cnn"), SGD, pull_timeout_s=30.0)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    model.synchronize()
    if broken == "consumer":
        monkeypatch.setattr(comm.Communicator, "_start", bug)
    else:
        monkeypatch.setattr(pushes.Pusher, "_stream", bug)
    started = time.monotonic()
    with pytest.raises(IMergeError) as info:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model(x)
    assert time.monotonic() - started < 10.0
    assert "the comm thread failed: RuntimeError: an unexpected bug" in str(info.value)
    assert not info.value.recoverable
    with pytest.raises(IMergeError, match="the comm thread failed"):  # and so does every later sync
        model.synchronize()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model(x)


def test_layout_mismatch_names_the_first_differing_parameter(cluster):
    c = cluster(2, 1)
    models = [build_model("digits-cnn"), torch.nn.Sequential(torch.nn.Linear(4, 3))]

    def body(rank: int):
        with pytest.raises(LayoutMismatchError) as info:
            imerge.distribute(models[rank], SGD, c.worker_config(rank))
        return str(info.value)

    for message in c.run_workers(body):
        assert "worker 1 disagrees with worker 0 at parameter #0: 0.bias [3] vs fc2.bias [10]" in message


def test_workers_whose_links_cut_other_blocks_are_refused_naming_the_flags(cluster):
    """--partition-mib 0 sizes the blocks from each worker's --link-mbps: workers that disagree on it would cut
    the model differently, and the refusal says which flags decide."""
    c = cluster(2, 1)

    def body(rank: int):
        with pytest.raises(LayoutMismatchError) as info:
            imerge.distribute(torch.nn.Linear(2048, 1024, bias=False), SGD,
                              c.worker_config(rank, link_mbps=(1000.0, 10000.0)[rank]))
        return str(info.value)

    for message in c.run_workers(body):
        assert ("worker 1 disagrees with worker 0 on option partition_bytes: 8388608 vs 1048576 (--partition-mib; "
                "where it is 0, the workers' --link-mbps)") in message


def test_missing_coordinator_times_out_naming_the_plan(redis_url):
    from imerge.worker.config import WorkerConfig

    config = WorkerConfig(job=new_job(), redis_url=redis_url, wait_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="waiting for the coordinator to publish the plan"):
        imerge.distribute(build_model("digits-cnn"), SGD, config)
    assert time.monotonic() - started < 5


def test_coordinator_times_out_naming_missing_shards(redis_url):
    from imerge.coordinator.service import Coordinator, CoordinatorConfig

    coordinator = Coordinator(CoordinatorConfig(job=new_job(), redis_url=redis_url, num_shards=2,
                                                wait_timeout_s=1.0))
    with pytest.raises(WaitTimeout, match=r"PS shards \[0, 1\] to register"):
        coordinator.publish_plan()


def test_unreachable_redis_is_a_store_error():
    store = Store("redis://127.0.0.1:1/0", "x", socket_timeout_s=1.0)
    with pytest.raises(StoreError, match="Redis at redis://127.0.0.1:1/0: ping failed"):
        store.ping()


def test_shards_only_accept_blocks_the_mapping_table_gives_them(cluster):
    import grpc
    import numpy as np

    from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

    c = cluster(1, 2)
    model = imerge.distribute(build_model("digits-cnn"), SGD, c.worker_config(0))
    plan = model.plan
    model.close()
    block = plan.blocks[0]
    wrong = c.addresses[1 - block.shard]
    spec = ps_pb2.BlockSpec(block_id=block.block_id, dtype=ps_pb2.FLOAT32, numel=block.numel, num_workers=1,
                            optimizer=ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}'))
    data = np.zeros(block.numel, dtype="<f4").tobytes()
    with grpc.insecure_channel(wrong) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for block_id, where in ((block.block_id, f"shard {block.shard}"), ("zz", "no shard")):
            spec.block_id = block_id
            with pytest.raises(grpc.RpcError) as info:
                stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec), ps_pb2.InitBlockChunk(data=data)]))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"mapped to {where}, not shard {1 - block.shard}" in info.value.details()


def test_late_release_by_an_old_holder_cannot_free_a_newer_holders_flag(redis_url):
    store = Store(redis_url, new_job())
    flag = Flag(1, 0, 0)
    contended, old_fence = dataclasses.astuple(store.acquire_flag(flag, "old", lease_s=0.3, timeout_s=5))
    assert contended is False
    started = time.monotonic()
    contended, new_fence = dataclasses.astuple(store.acquire_flag(flag, "new", lease_s=30, timeout_s=5))
    assert contended is True  # waited for the lease to expire
    assert 0.1 < time.monotonic() - started < 2.0
    assert new_fence > old_fence  # the fencing token grows with every grant
    assert store.release_flag(flag, "old") is False  # the old holder wakes up late
    with pytest.raises(WaitTimeout, match=r"slot flag 1:0:0 \(held by new\)"):
        store.acquire_flag(flag, "third", lease_s=1, timeout_s=0.5)
    assert store.release_flag(flag, "new") is True
    assert store.acquire_flag(flag, "third", lease_s=1, timeout_s=0.5).contended is False


def test_a_wait_with_a_sub_millisecond_remainder_still_times_out(redis_url):
    store = Store(redis_url, new_job())
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="waiting for the plan that never comes"):
        store.wait_plan(99, 0.0005, "the plan that never comes")  # BLPOP 0 would block forever
    assert time.monotonic() - started < 2.0


def test_a_finished_job_is_refused_and_fresh_starts_its_name_afresh(redis_url):
    from imerge.coordinator.service import Coordinator, CoordinatorConfig, JobFinished

    job = new_job()
    store = Store(redis_url, job)
    try:
        store.mark_done(0)
        store.mark_finished()
        with pytest.raises(JobFinished, match=rf"job {job} already finished at .* --fresh"):
            Coordinator(CoordinatorConfig(job=job, redis_url=redis_url), store).resume()
        fresh = Coordinator(CoordinatorConfig(job=job, redis_url=redis_url, fresh=True), store)
        assert fresh.resume() is False  # a new job: its keys are gone
        assert store.finished_at() is None and store.done_ranks() == set()
    finally:
        store.close()


def test_forged_reports_are_logged_and_ignored_and_the_job_finishes(cluster, caplog):
    """A worker's Redis user may write the report queues: a done-rank that is not a rank or not of this job, and
    failure reports that do not decode, are each logged and ignored; the coordinator goes on and the job ends
    when its real workers are done (before: a ValueError traceback ended the coordinator)."""
    import json
    import logging

    import redis

    c = cluster(2, 1)
    store = Store(c.redis_url, c.job)
    raw = redis.Redis.from_url(c.redis_url, decode_responses=True)
    raw.rpush(store._key("done", "queue"), "x", "7", "-1")  # noqa: SLF001 - the attack writes the raw key
    raw.rpush(store._key("failures", "queue"), "not json",  # noqa: SLF001
              json.dumps({"generation": "x", "who": "worker 0", "reason": "forged"}),
              json.dumps({"generation": 0, "who": 1, "reason": "forged"}))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    models = [build_model("digits-cnn") for _ in range(2)]

    def body(rank: int):
        model = imerge.distribute(models[rank], SGD, c.worker_config(rank))
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        model.close()

    with caplog.at_level(logging.WARNING, logger="imerge.coordinator"):
        c.run_workers(body)
        c._thread.join(30)  # noqa: SLF001 - the coordinator's thread ends when every worker is done
    assert c.coordinator_result == [0]
    ignored = [r.getMessage() for r in caplog.records if "was ignored" in r.getMessage()]
    assert len(ignored) == 6, ignored
    assert any("not a rank: 'x'" in m for m in ignored) and any("worker 7 finished" in m for m in ignored)
    assert store.generation() == 0  # no forged failure started a recovery


@pytest.mark.timeout(120)
def test_an_early_forged_done_ends_nothing_and_a_later_failure_is_still_handled(cluster, caplog):
    """While both workers train, a client marks both done (as a worker's Redis user may), then the shard is lost.
    A done counts only once its worker has left the job, so the coordinator watches on: the loss is handled (no
    checkpoint here, so the job fails naming why) and the workers end within seconds. Before, the forged marks
    ended the coordinator, and the workers waited for a recovery nobody would start until their timeouts."""
    import logging
    import threading
    import time

    import redis

    c = cluster(2, 1)
    store = Store(c.redis_url, c.job)
    raw = redis.Redis.from_url(c.redis_url, decode_responses=True)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    models = [build_model("digits-cnn") for _ in range(2)]
    training, attack_failed = threading.Event(), []

    def body(rank: int):
        model = imerge.distribute(models[rank], SGD, c.worker_config(rank))
        try:
            for step in range(500):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if step == 2:
                    training.set()
            model.close()
        except BaseException:  # leave now, not in the exit hook (which would end pytest with 75)
            model.abort()
            raise

    def attack() -> None:
        try:
            forge()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            attack_failed.append(exc)

    def forge() -> None:
        assert training.wait(60)
        for rank in (0, 1):
            store.mark_done(rank)
        deadline = time.monotonic() + 10
        while raw.llen(store._key("done", "queue")):  # noqa: SLF001 - until the coordinator took both marks
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        shard = c.shards[0]  # a real loss: its server stops, every worker's next call fails
        asyncio.run_coroutine_threadsafe(shard.server.stop(0), shard._loop).result(10)  # noqa: SLF001

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="imerge.coordinator"):
        with pytest.raises(Exception) as failed:
            c.run_workers(body)
    attacker.join(10)
    assert not attack_failed, attack_failed
    shard_named = c.addresses[0] in str(failed.value)  # "connection closed", "connection refused", ...
    assert shard_named or "no checkpoint round" in str(failed.value), failed.value
    assert time.monotonic() - started < 30
    assert not any("finished (" in r.getMessage() for r in caplog.records)  # no forged mark was counted
    assert store.finished_at() is None  # the job did not finish: it failed
    c._thread.join(10)  # noqa: SLF001 - the coordinator handled the loss and ended the job
    assert "no checkpoint round" in store.generation_event(1).error


def test_a_shard_stops_at_once_without_waiting_out_its_watch_for_the_next_generation(redis_url, monkeypatch):
    """The membership's watcher blocks in Redis for the next generation; stopping the shard ends that wait at once
    (it was waited out: WATCH_WAIT_S, 0.2 s of every shard's exit, and here 30 s, cut at the join's 10)."""
    from imerge.ps import membership
    from helpers import LocalCluster

    monkeypatch.setattr(membership, "WATCH_WAIT_S", 30.0)
    local = LocalCluster(redis_url, 1, 2, coordinator=False)
    time.sleep(0.5)  # both watchers are in their wait
    threads = [thread for shard in local.shards for thread in shard.server._membership._threads]
    started = time.monotonic()
    local.close()
    assert time.monotonic() - started < 3.0
    assert not [thread.name for thread in threads if thread.is_alive()]


def test_a_shard_stopped_in_the_middle_of_its_watchers_call_ends_it_quietly(redis_url, monkeypatch):
    """stop() closes the watcher's connection from another thread, so the call in flight fails however redis-py
    fails then (a ConnectionError, or its parser's buffer gone: AttributeError); the watcher ends without an
    unhandled exception. Short waits make the closes land in the middle of calls."""
    from imerge.ps import membership
    from helpers import LocalCluster

    monkeypatch.setattr(membership, "WATCH_WAIT_S", 0.01)
    unhandled: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(repr(args.exc_value)))
    for attempt in range(20):
        local = LocalCluster(redis_url, 1, 2, coordinator=False)
        time.sleep(0.05 + (attempt % 7) * 0.013)
        local.close()
    assert unhandled == []


def test_a_shard_stop_ends_a_pull_waiting_on_its_data_channel_at_once():
    """A pull on the data channel waits for its round on the shard's event loop; a stop (here ThreadedShard's,
    which then stops the loop) ends that wait at once, and the worker's pull fails then. It was waited out: the
    pull's deadline plus 5 s, then a refusal logged by a connection thread that outlived its shard."""
    from imerge.core.optim import OptimizerSpec
    from imerge.ps.config import PSConfig
    from imerge.ps.server import ThreadedShard
    from imerge.worker.transport import ShardClient

    shard = ThreadedShard(PSConfig(register=False, metrics_port=-1))
    before = set(threading.enumerate())
    outcome: list[BaseException] = []

    async def pull() -> None:
        client = ShardClient(shard.address, data_path="socket")
        try:
            await client.init_block("b", 2, OptimizerSpec("sgd", lr=0.1), torch.zeros(100), 30.0)
            await client.pull_into([("b", torch.empty(100))], 0, 0, 60.0)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)
        finally:
            await client.close()

    puller = threading.Thread(target=asyncio.run, args=(pull(),), daemon=True)
    puller.start()
    deadline = time.monotonic() + 10
    while not (serving := [t for t in threading.enumerate() if t.name == "ps0-data" and t not in before]):
        assert time.monotonic() < deadline, f"the pull's connection was never served: {outcome}"
        time.sleep(0.05)
    time.sleep(0.3)  # the pull is in its wait for round 0 (worker 1 never pushes)
    started = time.monotonic()
    shard.stop()
    for thread in serving:
        thread.join(5)
    puller.join(10)
    assert not [t.name for t in serving if t.is_alive()] and time.monotonic() - started < 8
    assert not puller.is_alive() and outcome, outcome
