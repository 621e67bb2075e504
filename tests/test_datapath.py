"""``imerge bench datapath``: PS against DDP on loopback, with throughput and CPU cost per process."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers import run_imerge


def test_datapath_reports_time_throughput_and_cpu_per_gb(tmp_path):
    result = run_imerge(["bench", "datapath", "--iters", "6", "--strategies", "ddp,imerge",  # gRPC's: test_bench
                         "--out", str(tmp_path)], 270)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["scenario"]["model_bytes"] == 4 * (2048 * 2048 + 2048) * 4
    assert list(report["strategies"]) == ["ddp", "imerge"]
    ddp, ps = report["strategies"]["ddp"], report["strategies"]["imerge"]
    assert ddp["ratio_to_ddp"] == 1.0 and ps["ratio_to_ddp"] > 0
    for result_of in (ddp, ps):
        assert result_of["median_iteration_s"] > 0
        assert 0 < result_of["worker_gb_per_s"] < 100 and 0 < result_of["worker_cpu_s_per_gb"] < 100
        # the comm threads: all but the training thread, whose forward and backward cost CPU of their own
        assert 0 < result_of["worker_comm_cpu_s_per_gb"] < result_of["worker_cpu_s_per_gb"]
    assert 0 < ps["shard_gb_per_s"] < 100 and 0 < ps["shard_cpu_s_per_gb"] < 100
    limits = report["socket_limit"]  # the machine's raw-socket limit, measured beside them in each round
    assert [limit["frame_bytes"] for limit in limits] == [1 << 20, 4 << 20]
    assert all(0 < limit[key] < 100 for limit in limits
               for key in ("receive_cpu_s_per_gb", "send_cpu_s_per_gb", "gb_per_s"))
    assert report["socket_limit_rounds"] == [limits]  # one round: its probes are the median
    assert ddp["shard_gb_per_s"] is None  # a DDP rank is reported in the worker columns only
    table = (tmp_path / "results.md").read_text()
    assert "| ddp |" in table and "| imerge |" in table
    assert "worker CPU s/GB" in table and "worker comm threads CPU s/GB" in table
    assert "| raw socket, 4 MiB frames |" in table


def test_datapath_names_an_unknown_strategy(tmp_path):
    result = subprocess.run([sys.executable, "-m", "imerge", "bench", "datapath", "--strategies", "ddp,nope",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--strategies: nope" in result.stderr and "Traceback" not in result.stderr


def test_the_socket_limit_is_the_median_of_each_frame_sizes_probes_over_the_rounds():
    from imerge.bench.socket_probe import ProbeResult, merged

    rounds = [[ProbeResult(1 << 20, 0.10, 0.20, 4.0), ProbeResult(4 << 20, 0.09, 0.15, 5.0)],
              [ProbeResult(1 << 20, 0.30, 0.18, 3.0), ProbeResult(4 << 20, 0.11, 0.19, 4.5)],
              [ProbeResult(1 << 20, 0.12, 0.26, 4.4), ProbeResult(4 << 20, 0.10, 0.14, 6.0)]]
    assert merged(rounds) == [ProbeResult(1 << 20, 0.12, 0.20, 4.0), ProbeResult(4 << 20, 0.10, 0.15, 5.0)]
    assert merged([]) == []
