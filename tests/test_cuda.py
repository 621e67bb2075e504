"""The built-in job on a GPU (where one is present) and device selection everywhere."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from imerge.ops.node import node_exit_code

IMERGE = [sys.executable, "-m", "imerge"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("role", ["worker", "launch"])
def test_device_cuda_without_a_gpu_fails_at_once_naming_the_option(role, monkeypatch, capsys):
    from helpers import run_cli

    for name in [k for k in os.environ if k.startswith("IMERGE_")]:
        monkeypatch.delenv(name)
    code, stderr = run_cli([role, "--device", "cuda"], {}, monkeypatch, capsys)  # fails before any role starts
    assert code == 2
    assert "--device: cuda was asked for, but torch sees no GPU" in stderr
    assert "Traceback" not in stderr


def test_a_node_exits_with_what_its_workers_say_together():
    assert node_exit_code([0, 0]) == 0
    assert node_exit_code([0, 75]) == 75  # a worker left to rejoin: the pod restarts
    assert node_exit_code([75, 76]) == 76  # fatal wins
    assert node_exit_code([3, -15]) == 3
    assert node_exit_code([-9, 0]) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_built_in_job_trains_on_the_gpu_with_device_auto(tmp_path):
    result = subprocess.run(IMERGE + ["launch", "--shards", "1", "--workers", "2", "--model", "resnet18",
                                      "--data", "synthetic", "--iters", "5", "--device", "auto",
                                      "--nproc-per-node", str(min(2, torch.cuda.device_count())),
                                      "--log-dir", str(tmp_path)], env=clean_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        log = (tmp_path / f"worker{rank}.log").read_text()
        assert f"trains resnet18 on cuda:{rank % min(2, torch.cuda.device_count())}" in log, log[-2000:]
