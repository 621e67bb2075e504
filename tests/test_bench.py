"""A tiny benchmark scenario runs end to end on the testbed and reports every field."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from imerge.bench.runner import SCENARIOS

from helpers import run_imerge

STRATEGIES = tuple(s for s in SCENARIOS["tiny"].strategies if s != "imerge")  # the data channel: test_datapath

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="the testbed needs root and iproute2")
FIELDS = {"median_iteration_s", "p90_iteration_s", "compute_s", "exposed_comm_s", "bytes_per_iteration",
          "link_utilization", "bound_s", "ratio_to_bound", "ratio_to_ddp", "push_p50_ms", "push_p99_ms",
          "tcp_retransmissions", "tcp_retransmissions_per_host"}


def test_tiny_scenario_reports_every_strategy_and_field(tmp_path):
    result = run_imerge(["bench", "tiny", "--strategies", ",".join(STRATEGIES), "--out", str(tmp_path)], 270)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report["strategies"]) == list(STRATEGIES)
    for name, strategy in report["strategies"].items():
        missing = FIELDS - set(strategy)
        assert not missing, f"{name} lacks {missing}"
        assert strategy["median_iteration_s"] > 0 and strategy["bytes_per_iteration"] > 0, name
        assert strategy["ratio_to_ddp"] > 0 and strategy["ratio_to_bound"] > 0, name
        if name != "ddp":
            assert strategy["compute_s"] > 0 and strategy["exposed_comm_s"] is not None, name
        assert sum(strategy["tcp_retransmissions_per_host"].values()) == strategy["tcp_retransmissions"], name
    assert report["strategies"]["ddp"]["ratio_to_ddp"] == 1.0
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in table for name in STRATEGIES)
    for plot in ("iteration_time.png", "timeline.png", "link_utilization.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG", plot
    assert f"| {STRATEGIES[1]} |" in result.stdout


def test_a_ddp_rank_stuck_before_its_first_iteration_prints_its_stacks_and_exits_for_a_restart(tmp_path):
    """The DDP baseline's watchdog: a rank whose rendezvous does not complete (here rank 1 of 2, with no rank 0
    to meet) prints where every thread waits and exits 1 within IMERGE_DDP_STARTUP_S, which the launcher
    restarts, instead of hanging the benchmark."""
    env = {**os.environ, "IMERGE_RANK": "1", "IMERGE_WORLD_SIZE": "2", "IMERGE_DDP_MASTER": "127.0.0.1:1",
           "IMERGE_DDP_STARTUP_S": "3", "IMERGE_MODEL": "digits-cnn", "IMERGE_DATA": "synthetic"}
    result = subprocess.run([sys.executable, "-m", "imerge.bench.ddp_baseline"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Timeout (0:00:03)!" in result.stderr and "init_process_group" in result.stderr


def test_a_stuck_imerge_process_tells_where_its_threads_wait(tmp_path):
    """``kill -USR1`` makes an IMerge process print every thread's stack and go on; the tests' runner of imerge
    commands asks a command that overran for them before it kills it."""
    with pytest.raises(AssertionError, match=r"(?s)still ran after 3s.*Thread 0x.*most recent call first"):
        run_imerge(["simulate", "--model", "resnet18", "--iters", "1000000", "--out", str(tmp_path)], 3)
