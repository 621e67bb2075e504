"""--thread-policy (core/scheduling.py): the data path's threads under SCHED_BATCH, the user's threads and
choices left alone."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch.nn.functional as F

from imerge.core.errors import ConfigError
from imerge.core.optim import OptimizerSpec
from imerge.core.scheduling import apply_thread_policy, thread_policy
from imerge.ps.config import PSConfig
from test_request_bounds import ShardProcess
from test_training_loop import Branchy, one_batch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling policies")


def in_thread(function, *args):
    """``function(*args)`` on a new thread (whose policy it may change without touching this one's)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function(*args)))
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{function.__name__} did not return within 60s"
    return result[0]


def policies(pid: int) -> set[str]:
    """The scheduling policies of every thread of process ``pid``."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(thread_policy(int(task.name)))
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass
    return found


def test_batch_is_set_on_the_calling_thread_inherited_by_its_threads_and_a_users_choice_is_kept():
    def batch_then_child() -> tuple[bool, str, str]:
        changed = apply_thread_policy("batch", "test")
        return changed, thread_policy(), in_thread(thread_policy)

    assert in_thread(batch_then_child) == (True, "SCHED_BATCH", "SCHED_BATCH")
    assert in_thread(lambda: (apply_thread_policy("normal", "test"), thread_policy())) == (False, "SCHED_OTHER")

    def idle_then_batch() -> tuple[bool, str]:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # as `chrt -i 0` would
        return apply_thread_policy("batch", "test"), thread_policy()

    assert in_thread(idle_then_batch) == (False, "SCHED_IDLE")
    assert thread_policy() == "SCHED_OTHER"  # this thread was never touched


def test_an_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--thread-policy.*'fifo'.*batch, normal"):
        PSConfig(thread_policy="fifo")


@pytest.mark.parametrize("args, expected", [((), {"SCHED_BATCH"}), (("--thread-policy", "normal"), {"SCHED_OTHER"})])
def test_every_thread_of_a_shard_process_runs_under_its_policy(tmp_path, args, expected):
    shard = ShardProcess(tmp_path, "--data-port", "0", *args)
    try:
        assert len(os.listdir(f"/proc/{shard.process.pid}/task")) > 3  # gRPC's, the event loop's, the channel's
        assert policies(shard.process.pid) == expected
    finally:
        shard.stop()


def test_a_shard_started_under_sched_idle_keeps_it(tmp_path):
    def start() -> ShardProcess:  # the child inherits the policy of the thread that forks it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return ShardProcess(tmp_path)

    shard = in_thread(start)
    try:
        assert policies(shard.process.pid) == {"SCHED_IDLE"}
    finally:
        shard.stop()


def test_a_workers_comm_and_data_threads_run_batch_and_the_training_thread_keeps_its_policy(lone):
    model = lone(Branchy(), OptimizerSpec("sgd", lr=0.1))
    x, y = one_batch()
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    model.synchronize()
    ours = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith(("imerge-comm", "imerge-data"))}
    assert any(name.startswith("imerge-data") for name in ours), f"no data channel thread among {sorted(ours)}"
    assert {name: thread_policy(tid) for name, tid in ours.items()} == {name: "SCHED_BATCH" for name in ours}
    assert thread_policy() == "SCHED_OTHER"


def test_a_system_that_refuses_the_policy_leaves_the_default_with_one_log_line(monkeypatch, caplog):
    def refused(*args):  # as a seccomp profile that forbids sched_setscheduler answers
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    with caplog.at_level("INFO", logger="imerge.core.scheduling"):
        assert in_thread(lambda: (apply_thread_policy("batch", "shard 3", whole_process=True), thread_policy())) \
            == (False, "SCHED_OTHER")
    assert [r.getMessage() for r in caplog.records] == [
        "shard 3: the system refused SCHED_BATCH ([Errno 1] Operation not permitted); its threads keep the default "
        "policy"]
