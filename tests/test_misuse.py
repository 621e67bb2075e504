"""Uses of the wrapped model that would train wrongly are refused at once, naming the cause."""
from __future__ import annotations

import concurrent.futures
import copy
import threading
import time

import pytest
import torch

import imerge
from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec
from imerge.workloads.models import build_model


def test_a_second_backward_without_a_forward_raises_at_once_on_that_rank(cluster):
    """Two backward passes of one forward would be two optimizer steps on the shards (and, on one rank only, a
    job out of step): the second raises on that rank before anything is pushed. The refusal is the job's end
    whatever the script does with it: the job fails naming it, and the model raises it again if used."""
    from imerge.control.store import Store

    c = cluster(2, 1)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))

    def body(rank: int):
        model = imerge.distribute(build_model("digits-cnn"), OptimizerSpec("sgd", lr=0.05), c.worker_config(rank))
        try:
            for _ in range(2):
                torch.nn.functional.cross_entropy(model(x), y).backward()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward(retain_graph=True)
            if rank == 1:
                started = time.monotonic()
                with pytest.raises(UnsupportedUse, match="second backward after iteration 3 without a forward"):
                    loss.backward()
                refused_after_s = time.monotonic() - started
                with pytest.raises(UnsupportedUse, match="second backward after iteration 3"):
                    model.synchronize()  # the script caught it and went on: the job failed with it
                iterations = model._engine.iteration
                with pytest.raises(UnsupportedUse, match="second backward after iteration 3"):
                    model.close()  # no last sync, no done mark
                return refused_after_s, iterations
            return 0.0, model._engine.iteration
        finally:
            model.abort()

    (_, iterations0), (refused_after_s, iterations1) = c.run_workers(body)
    assert refused_after_s < 1.0 and iterations0 == iterations1 == 3  # refused, not counted as an iteration
    store = Store(c.redis_url, c.job)
    try:
        deadline = time.monotonic() + 10
        while (event := store.generation_event(1)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert event is not None and "worker 1: UnsupportedUse: worker 1: a second backward" in event.error
        assert 1 not in store.done_ranks()
    finally:
        store.close()


def test_a_second_process_claiming_a_live_rank_is_refused_and_the_job_is_untouched(cluster):
    """A duplicate of rank 1, started while the job runs, gets RankInUse within 10 s (the holder's next lease
    renewal proves it alive) before it writes anything of the job; the job trains exactly as it would alone."""
    from loop_reference import make_data, params_of
    from imerge.core.errors import RankInUse

    c = cluster(2, 1)
    data = make_data(14, 2, 8, 8, 4)
    rank1_training = threading.Event()
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    make = lambda: copy.deepcopy(initial)  # noqa: E731

    def train(rank: int, slow: bool):
        model = imerge.distribute(make(), OptimizerSpec("sgd", lr=0.1), c.worker_config(rank, heartbeat_ttl_s=6))
        for index, step in enumerate(data):
            x, y = step[rank]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if slow:
                time.sleep(0.4)
            if index == 1 and rank == 1:
                rank1_training.set()
        model.close()
        return params_of(model.module)

    def duplicate():
        assert rank1_training.wait(60)
        started = time.monotonic()
        with pytest.raises(RankInUse, match=r"rank 1 of job .* is held by a live process"):
            imerge.distribute(make(), OptimizerSpec("sgd", lr=0.1), c.worker_config(1, heartbeat_ttl_s=6))
        return time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(train, rank, True) for rank in range(2)]
        refused_after_s = pool.submit(duplicate).result(90)
        results = [run.result(120) for run in runs]
    assert refused_after_s < 10.0
    c = cluster(2, 1)  # the same job alone
    expected = c.run_workers(lambda rank: train(rank, False))
    for name, value in expected[0].items():
        assert torch.equal(results[0][name], value) and torch.equal(results[1][name], value), name


def test_a_rank_whose_holder_is_gone_is_taken_at_once_and_an_expired_one_within_its_lease(redis_url):
    """A lease left by a process of this host that no longer exists is replaced at once (a restarted worker does
    not wait); one of another host, never renewed, is taken once it expires."""
    import socket
    import subprocess
    import sys

    from helpers import new_job
    from imerge.control.messages import RankHolder
    from imerge.control.store import Store
    from imerge.worker.lease import RankLease

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = Store(redis_url, new_job())
    try:
        assert store.claim_rank(0, RankHolder(socket.gethostname(), int(gone.stdout), "x"), 30) is None
        started = time.monotonic()
        RankLease(store, store.job, 0, 30).claim()
        assert time.monotonic() - started < 1.0
        assert store.claim_rank(1, RankHolder("elsewhere", 1, "x"), 1.5) is None
        started = time.monotonic()
        lease = RankLease(store, store.job, 1, 1.5)
        lease.claim()
        assert 0.5 < time.monotonic() - started < 3.5
        assert store.claim_rank(1, RankHolder("late", 2, "x"), 10) is not None  # now held by the new lease
        lease.renew()
        assert not lease.lost
    finally:
        store.close()
