"""The changes IMerge makes to torch and the interpreter in a training process: all installed by the first
distributed model, refused removal while a model is open, all taken back by torch_patches.remove()."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
import torch, torch.nn.utils, torch.nn.utils.clip_grad
import imerge
from imerge.core.errors import IMergeError
from imerge.core.optim import OptimizerSpec
from imerge.worker import torch_patches
from imerge.worker.config import WorkerConfig

def seen():
    return {
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad_value_": torch.nn.utils.clip_grad_value_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
        "_get_total_norm": torch.nn.utils.clip_grad._get_total_norm,
        "Optimizer.__init__": torch.optim.Optimizer.__init__,
        "GradScaler.scale": torch.amp.GradScaler.scale,
        "GradScaler.unscale_": torch.amp.GradScaler.unscale_,
        "GradScaler.step": torch.amp.GradScaler.step,
        "excepthook": sys.excepthook,
    }

torchs = seen()
assert not torch_patches.installed()
model = imerge.distribute(torch.nn.Linear(4, 2), OptimizerSpec("sgd", lr=0.1),
                          WorkerConfig(job=sys.argv[2], redis_url=sys.argv[1], rank=0, world_size=1))
assert torch_patches.installed()
patched = seen()
unchanged = [name for name in torchs if patched[name] is torchs[name]]
assert unchanged == [], f"not patched: {unchanged}"
model(torch.ones(1, 4)).sum().backward()
try:
    torch_patches.remove()
    raise SystemExit("removed while a model is open")
except IMergeError as exc:
    assert "1 IMerge model(s) of this process are still open" in str(exc), exc
assert seen() == patched
model.close()
torch_patches.remove()
restored = seen()
left = [name for name in torchs if restored[name] is not torchs[name]]
assert left == [], f"not restored: {left}"
assert not torch_patches.installed()
torch_patches.remove()  # idempotent
torch_patches.install()
assert torch_patches.installed() and seen()["Optimizer.__init__"] is not torchs["Optimizer.__init__"]
print("ok")
"""


def test_every_patch_is_installed_by_the_first_model_and_all_are_removed_together(cluster):
    c = cluster(1, 1)
    result = subprocess.run([sys.executable, "-c", SCRIPT, c.redis_url, c.job], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
