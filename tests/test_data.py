"""The built-in digits: the values scikit-learn's ``load_digits`` gives, read without importing scikit-learn."""
from __future__ import annotations

import subprocess
import sys

import torch
from sklearn.datasets import load_digits

from imerge.workloads.data import digits

READ_IN_A_FRESH_PROCESS = """
import sys
from imerge.workloads.data import digits
train, test = digits("train", 7), digits("test", 7)
print(int("sklearn" in sys.modules), float(train.tensors[0].double().sum()), int(train.tensors[1].sum()),
      len(train), len(test))
"""


def test_digits_are_load_digits_values_and_a_worker_does_not_import_scikit_learn() -> None:
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(7))
    train, test = digits("train", 7), digits("test", 7)
    assert torch.equal(train.tensors[0], images[order[:1437]]) and torch.equal(train.tensors[1], labels[order[:1437]])
    assert torch.equal(test.tensors[0], images[order[1437:]]) and torch.equal(test.tensors[1], labels[order[1437:]])
    answer = subprocess.run([sys.executable, "-c", READ_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                            timeout=60, check=True).stdout.split()
    assert answer == ["0", str(float(train.tensors[0].double().sum())), str(int(train.tensors[1].sum())),
                      "1437", "360"]
