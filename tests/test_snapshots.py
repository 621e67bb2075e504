"""A dense block's snapshots live in kept buffers: never overwritten while a pull holds one, reused once dropped."""
from __future__ import annotations

import gc

import pytest
import torch

from imerge.ps.block import SnapshotBuffers


def test_a_held_snapshot_keeps_its_round_while_later_rounds_publish():
    buffers, param = SnapshotBuffers("float32", 1000), torch.arange(1000.0)
    held = buffers.snapshot(param)  # a pull still sending round 0
    for _ in range(20):
        param += 1
        buffers.snapshot(param)  # dropped at once, as a snapshot nobody pulls
    assert bytes(held.parts[0]) == torch.arange(1000.0).numpy().tobytes() and held.nbytes == 4000
    assert buffers.allocated == 2  # the held one, and one reused by the other twenty


def test_a_dropped_snapshot_gives_its_buffer_back_and_no_more_than_two_are_kept():
    buffers, param = SnapshotBuffers("float32", 64), torch.zeros(64)
    current = buffers.snapshot(param)
    for _ in range(50):  # the steady state: the previous round's snapshot is dropped after the next one is made
        current = buffers.snapshot(param)
    assert buffers.allocated == 2
    many = [buffers.snapshot(param) for _ in range(5)]  # five held at once: five buffers
    del many, current
    gc.collect()
    assert len(buffers._free) == SnapshotBuffers.KEPT


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cast_snapshot_rounds_as_tensor_to_does(dtype):
    param = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e3
    snapshot = SnapshotBuffers(dtype, param.numel()).snapshot(param)
    expected = param.to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
    assert bytes(snapshot.parts[0]) == expected and snapshot.dtype == dtype and snapshot.nbytes == 20_000
