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
    assert buffers.waiting == SnapshotBuffers.KEPT


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cast_snapshot_rounds_as_tensor_to_does(dtype):
    param = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e3
    snapshot = SnapshotBuffers(dtype, param.numel()).snapshot(param)
    expected = param.to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
    assert bytes(snapshot.parts[0]) == expected and snapshot.dtype == dtype and snapshot.nbytes == 20_000


@pytest.mark.parametrize("compression", ["", "fp16"])
def test_a_checkpoints_image_keeps_its_rounds_parameters_while_the_block_steps_on(compression):
    """A dense float32 block's image holds its published snapshot (no copy), a block that sends fp16 copies its
    float32 parameters: either way the image is the parameters of its round, bit for bit, however many rounds
    the block steps and publishes while the checkpoint is being written."""
    from imerge.core.optim import OptimizerSpec
    from imerge.core.rounds import RoundOptions
    from imerge.ps.block import BlockMeta, BlockState
    from imerge.ps.metrics import ShardCounters, ShardMetrics

    meta = BlockMeta("b", "float32", 5_000, 2, OptimizerSpec("sgd", lr=0.1, momentum=0.9), (1_000, 4_000),
                     compression)
    block = BlockState(meta, torch.randn(5_000, generator=torch.Generator().manual_seed(0)), "d")
    metrics, generator = ShardMetrics(0, ShardCounters(), 1e4), torch.Generator().manual_seed(1)

    def round_() -> None:
        block.grads.copy_(torch.randn(2, 5_000, generator=generator))
        block.snapshot = block.aggregate(metrics, RoundOptions(), set())

    for _ in range(3):
        round_()
    image, expected = block.image(), block.flat.clone()
    momentum = block.optimizer.state[block.pieces[1]]["momentum_buffer"].clone()
    assert (image.owner is block.snapshot) == (compression == "")  # fp16: its snapshot is not the parameters
    for _ in range(10):
        round_()
    gc.collect()
    assert not torch.equal(block.flat, expected)
    assert torch.equal(image.param, expected) and image.param.dtype == torch.float32
    assert torch.equal(image.state["1/momentum_buffer"], momentum)
    second = block.image()  # while the first is still held: copies of its own
    assert torch.equal(image.state["1/momentum_buffer"], momentum)
    kept = image.state["1/momentum_buffer"].data_ptr()
    del image
    gc.collect()
    round_()
    third = block.image()  # the first one's copies, reused
    assert third.state["1/momentum_buffer"].data_ptr() == kept != second.state["1/momentum_buffer"].data_ptr()
    assert torch.equal(third.state["1/momentum_buffer"], block.optimizer.state[block.pieces[1]]["momentum_buffer"])


def test_a_native_step_writes_the_next_rounds_parameters_into_the_snapshot_it_publishes():
    """The step reads one round's parameters and writes the next round's straight into the buffer of the snapshot
    it publishes, which holds the block's parameters from then on (no copy of them per round); a step that writes
    in place (torch's, for a piece without gradient; an assignment) first moves them to memory of their own, so a
    snapshot a pull still sends never changes."""
    from imerge.core import native
    from imerge.core.optim import OptimizerSpec
    from imerge.core.rounds import RoundOptions
    from imerge.ps.block import BlockMeta, BlockState
    from imerge.ps.metrics import ShardCounters, ShardMetrics

    if not native.native_available():
        pytest.skip(native.why_unavailable())
    meta = BlockMeta("b", "float32", 5_000, 2, OptimizerSpec("sgd", lr=0.1, momentum=0.9), (1_000, 4_000))
    block = BlockState(meta, torch.randn(5_000, generator=torch.Generator().manual_seed(0)), "d")
    metrics, generator = ShardMetrics(0, ShardCounters(), 1e4), torch.Generator().manual_seed(1)

    def round_(options: RoundOptions = RoundOptions(), no_grad: frozenset[int] = frozenset()) -> None:
        block.grads.copy_(torch.randn(2, 5_000, generator=generator))
        block.snapshot = block.aggregate(metrics, options, no_grad)

    def address(snapshot: object) -> int:
        return torch.frombuffer(snapshot.parts[0], dtype=torch.float32).data_ptr()  # type: ignore[attr-defined]

    for _ in range(3):
        round_()
    assert block.flat.data_ptr() == address(block.snapshot)
    assert [piece.data_ptr() for piece in block.pieces] == [address(block.snapshot), address(block.snapshot) + 4_000]
    held = block.snapshot  # a pull still sending it
    expected = bytes(held.parts[0])
    for _ in range(10):
        round_()
    gc.collect()
    assert bytes(held.parts[0]) == expected and bytes(block.snapshot.parts[0]) != expected
    assert block._buffers is not None and block._buffers.allocated == 3  # the held one, and two in turn
    for torch_round in (lambda: round_(no_grad=frozenset({0})), lambda: round_(RoundOptions(assign=True))):
        round_()  # native: the parameters in the published snapshot's buffer
        held, before = block.snapshot, block.flat.clone()
        assert block.flat.data_ptr() == address(held)
        expected = bytes(held.parts[0])
        torch_round()
        assert bytes(held.parts[0]) == expected and block.flat.data_ptr() != address(held)
        assert not torch.equal(block.flat, before)
        assert bytes(block.snapshot.parts[0]) == block.flat.numpy().tobytes()
    assert torch.equal(block.flat, block.grads[0])  # the assignment's
    round_()  # native again: back in a snapshot's buffer
    assert block.flat.data_ptr() == address(block.snapshot)


def test_an_import_leaves_the_snapshot_that_held_the_parameters_as_it_was(request):
    """An import (``imerge.load``) writes the parameters in place: after a native step they lie in the published
    snapshot's buffer, which a pull may still be sending, so the shard first moves them to memory of their own."""
    from safetensors.torch import save

    from imerge.core import native
    from imerge.core.optim import OptimizerSpec
    from imerge.core.rounds import RoundOptions
    from imerge.ps.block import BlockMeta, BlockState
    from imerge.ps.metrics import ShardCounters, ShardMetrics
    from imerge.ps.state import Shard

    if not native.native_available():
        pytest.skip(native.why_unavailable())
    shard = Shard(0, threads=1)
    request.addfinalizer(shard.close)
    block = shard.blocks["b"] = BlockState(
        BlockMeta("b", "float32", 64, 2, OptimizerSpec("sgd", lr=0.1, momentum=0.9)), torch.randn(64), "d")
    metrics = ShardMetrics(0, ShardCounters(), 1e4)
    for _ in range(2):
        block.grads.copy_(torch.randn(2, 64))
        block.snapshot = block.aggregate(metrics, RoundOptions(), set())
    held = block.snapshot  # a pull still sending it
    expected = bytes(held.parts[0])
    assert block.flat.data_ptr() == torch.frombuffer(held.parts[0], dtype=torch.float32).data_ptr()
    shard.import_blocks({"b": save({"param": torch.full((64,), 3.0),
                                    "state/0/momentum_buffer": torch.zeros(64)})}, 0)
    assert bytes(held.parts[0]) == expected
    assert torch.equal(block.flat, torch.full((64,), 3.0))
    assert bytes(block.snapshot.parts[0]) == torch.full((64,), 3.0).numpy().tobytes()
