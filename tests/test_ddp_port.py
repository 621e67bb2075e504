"""A DDP script ported by its wrap line (and clipping) trains exactly as under torchrun with DDP."""
from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from imerge.ops.redis_server import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("IMERGE_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def test_the_port_changes_only_the_import_the_wrap_line_and_clipping():
    ddp = (EXAMPLES / "gpt_ddp.py").read_text().splitlines()
    ported = (EXAMPLES / "gpt_imerge.py").read_text().splitlines()
    changed = [line[1:].strip() for line in difflib.unified_diff(ddp, ported, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert sorted(changed) == sorted([
        "from torch.nn.parallel import DistributedDataParallel as DDP", "import imerge",
        "model = DDP(model)", "model = imerge.distribute(model)",
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)", "model.clip_grad_norm_(0.5)",
        "model.clip_grad_norm_(0.5)"])


@pytest.mark.timeout(300)
def test_the_ported_script_under_imerge_launch_equals_the_ddp_script_under_torchrun(tmp_path):
    """Two workers each: the same loss every iteration and the same saved model (within 1e-5 relative), read right
    after the loop (no close(): the script exits, IMerge leaves the job at exit)."""
    ddp = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-port", str(free_port()), str(EXAMPLES / "gpt_ddp.py"),
                            "--out", str(tmp_path / "ddp.pt"), "--losses", str(tmp_path / "ddp.json")],
                           env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ported = subprocess.Popen([sys.executable, "-m", "imerge", "launch", "--shards", "1", "--workers", "2",
                               "--log-dir", str(tmp_path / "logs"), "--summary-json", str(tmp_path / "summary.json"),
                               "--", sys.executable, str(EXAMPLES / "gpt_imerge.py"),
                               "--out", str(tmp_path / "imerge.pt"), "--losses", str(tmp_path / "imerge.json")],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ddp_output, _ = ddp.communicate(timeout=240)
    ported_output, _ = ported.communicate(timeout=240)
    assert ddp.returncode == 0, ddp_output
    assert ported.returncode == 0, ported_output
    expected, losses = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("ddp", "imerge"))
    assert len(expected) == len(losses) == 6
    assert losses == pytest.approx(expected, rel=1e-5)
    reference = torch.load(tmp_path / "ddp.pt", weights_only=True)
    trained = torch.load(tmp_path / "imerge.pt", weights_only=True)
    assert sorted(trained) == sorted(reference)
    for name, value in reference.items():  # relative to the tensor's norm (a bias starts at zero)
        assert float((trained[name] - value).norm() / value.norm()) < 1e-5, name
    assert "[rank1]: iteration 5 loss" in ported_output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == 0
