"""Shard checkpoints: atomic on disk, verified on read, and a kill -9 mid-write leaves the previous one valid."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

from imerge.core.optim import OptimizerSpec
from imerge.ps.checkpoint import MANIFEST, TENSORS, BlockImage, CheckpointError, CheckpointStore

SGD = OptimizerSpec("sgd", lr=0.1, momentum=0.9)


def image(block_id: str, numel: int, seed: int) -> BlockImage:
    generator = torch.Generator().manual_seed(seed)
    return BlockImage(block_id, 2, SGD, f"digest-{block_id}", torch.randn(numel, generator=generator),
                      {"momentum_buffer": torch.randn(numel, generator=generator)})


def test_the_round_the_shards_hold_in_common_survives_the_prune(tmp_path):
    """A shard a checkpoint ahead of another (shard 1 still writing round 8 when it is killed) keeps the round they
    share: pruning it too would leave a recovery no round held by every shard."""
    store = CheckpointStore(tmp_path, shard=0, keep=2)
    for round_ in (0, 4, 8):
        store.write(round_, [image("g0", 10, round_)], held=4 if round_ == 8 else None)
    store.write(12, [image("g0", 10, 12)], held=4)
    assert store.rounds() == [4, 8, 12]
    store.write(16, [image("g0", 10, 16)], held=12)  # the others caught up: the old one goes
    assert store.rounds() == [12, 16]


def test_written_checkpoint_reads_back_exactly_and_only_the_newest_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, shard=3, keep=2)
    written = {r: [image("g0", 10, r), image("g1.p0", 7, r + 100)] for r in (0, 4, 8)}
    for round_, blocks in written.items():
        store.write(round_, blocks)
    assert store.rounds() == [4, 8]
    restored = store.read(8)
    assert restored.round == 8 and set(restored.blocks) == {"g0", "g1.p0"}
    for original in written[8]:
        got = restored.blocks[original.block_id]
        assert torch.equal(got.param, original.param)
        assert torch.equal(got.state["momentum_buffer"], original.state["momentum_buffer"])
        assert got.optimizer == SGD and got.num_workers == 2 and got.init_digest == original.init_digest
    manifest = json.loads((store.folder / "round-000000000008" / MANIFEST).read_text())
    assert manifest["round"] == 8 and manifest["format"] == 3
    assert manifest["crc32"] == zlib.crc32((store.folder / "round-000000000008" / TENSORS).read_bytes())
    with pytest.raises(CheckpointError, match=r"round 0 .* does not exist \(complete rounds: \[4, 8\]\)"):
        store.read(0)


def test_a_corrupted_checkpoint_fails_its_checksum(tmp_path):
    store = CheckpointStore(tmp_path, shard=0)
    path = store.write(2, [image("g0", 1000, 1)])
    data = bytearray((path / TENSORS).read_bytes())
    data[-5] ^= 0xFF
    (path / TENSORS).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its CRC-32 checksum"):
        store.read(2)
    (path / TENSORS).write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match="missing or not"):
        store.read(2)


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "page-cache"])
def test_the_tensor_file_is_safetensors_and_its_crc_the_files(tmp_path, direct):
    """The tensor file, written past the page cache or through it, is read back by safetensors bit for bit for
    every dtype and shape a block's state may hold (a 0-d step, an empty piece, bfloat16, int64, bool, complex,
    unsigned, float8, a piece larger than the staging buffer and not a multiple of the disk's block), and the
    CRC-32 taken while writing is the file's."""
    from safetensors.torch import load_file

    from imerge.ps import tensorfile

    generator = torch.Generator().manual_seed(3)
    tensors = {"g0/state/0/step": torch.tensor(7.0), "g0/state/0/exp_avg": torch.randn(999, generator=generator),
               "g0/state/1/empty": torch.zeros(0), "g0/state/1/count": torch.arange(5),
               "g0/state/1/half": torch.randn(33, generator=generator).to(torch.bfloat16),
               "g0/state/1/flag": torch.tensor([True, False, True]),
               "g0/state/2/complex": torch.randn(7, generator=generator, dtype=torch.complex64),
               "g0/state/2/unsigned": torch.arange(9, dtype=torch.int64).to(torch.uint32),
               "g0/state/2/fp8": torch.randn(11, generator=generator).to(torch.float8_e4m3fn),
               "g0/param": torch.randn(tensorfile.CHUNK // 4 + 1001, generator=generator)}
    written = tensorfile.write_tensors(tmp_path / TENSORS, tensors, direct=direct)
    data = (tmp_path / TENSORS).read_bytes()
    assert (written.size, written.crc32, written.direct) == (len(data), zlib.crc32(data), direct)
    loaded = load_file(str(tmp_path / TENSORS))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name  # bits
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0  # the data start 8-aligned
    with pytest.raises(ValueError, match="g0/x: dtype torch.complex128 has no safetensors name"):
        tensorfile.write_tensors(tmp_path / "other", {"g0/x": torch.zeros(2, dtype=torch.complex128)}, direct=direct)
    with pytest.raises(ValueError, match="g0/x: on meta, not in the CPU's memory"):
        tensorfile.write_tensors(tmp_path / "other", {"g0/x": torch.zeros(2, device="meta")}, direct=direct)
    assert not (tmp_path / "other").exists()  # refused before the file was made


def test_a_file_system_that_refuses_o_direct_gets_the_page_cache(tmp_path, monkeypatch, caplog):
    """Where opening with O_DIRECT fails with EINVAL the checkpoint is written through the page cache, the same
    bytes, and the log says so once; the checkpoint reads back."""
    import errno

    from imerge.ps import tensorfile

    opened = []

    def refusing(path, direct):
        opened.append(direct)
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    monkeypatch.setattr(tensorfile, "_open", refusing)
    monkeypatch.setattr(tensorfile, "_refused", set())
    store, written = CheckpointStore(tmp_path, shard=0), image("g0", 1000, 1)
    with caplog.at_level(logging.INFO, logger="imerge.ps.tensorfile"):
        store.write(1, [written])
        store.write(2, [written])
    assert opened == [True, False, False]  # the refusal is remembered for the device
    assert [r.message for r in caplog.records].count(
        f"checkpoints in {tmp_path / 'shard-0' / '.tmp-000000000001-'}{os.getpid()} go through the page cache: "
        "its file system refuses O_DIRECT") == 1
    assert torch.equal(store.read(2).blocks["g0"].param, written.param)


def test_a_checkpoint_of_format_2_with_its_sha256_is_still_read_and_checked(tmp_path):
    store = CheckpointStore(tmp_path, shard=0)
    written = image("g0", 1000, 1)
    path = store.write(2, [written])
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["crc32"]
    manifest.update(format=2, sha256=hashlib.sha256((path / TENSORS).read_bytes()).hexdigest())
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert torch.equal(store.read(2).blocks["g0"].param, written.param)
    data = bytearray((path / TENSORS).read_bytes())
    data[-5] ^= 0xFF
    (path / TENSORS).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its SHA-256 checksum"):
        store.read(2)
    manifest["format"] = 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest has format 1"):
        store.read(2)


WRITER = """
import sys, torch
from imerge.core.optim import OptimizerSpec
from imerge.ps.checkpoint import BlockImage, CheckpointStore
store = CheckpointStore(sys.argv[1], shard=0)
small = BlockImage("g0", 2, OptimizerSpec(), "d", torch.arange(1000, dtype=torch.float32), {})
store.write(1, [small])
print("written", flush=True)
big = [BlockImage(f"g{i}", 2, OptimizerSpec(), "d", torch.ones(1 << 24), {"momentum_buffer": torch.ones(1 << 24)})
       for i in range(6)]
store.write(2, big)
print("second written", flush=True)
"""


@pytest.mark.timeout(120)
def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_restorable(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "written"
    folder = tmp_path / "shard-0"
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".tmp-000000000002") for p in folder.iterdir()):
        assert time.monotonic() < deadline and writer.poll() is None, "the second write never started"
        time.sleep(0.005)
    time.sleep(0.2)  # well into writing 768 MiB of tensors
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(30)
    assert writer.returncode == -signal.SIGKILL
    store = CheckpointStore(tmp_path, shard=0)
    assert store.rounds() == [1]  # the interrupted round 2 is not a checkpoint
    assert any(p.name.startswith(".tmp-") for p in folder.iterdir())  # it died mid-write
    restored = store.read(1)
    assert torch.equal(restored.blocks["g0"].param, torch.arange(1000, dtype=torch.float32))
    store.write(3, [restored.blocks["g0"]])  # the next writer removes the dead one's temporary folder
    assert store.rounds() == [1, 3] and not any(p.name.startswith(".tmp-") for p in folder.iterdir())


def test_checkpoints_of_an_earlier_run_are_ignored_refused_and_removed(tmp_path):
    earlier = CheckpointStore(tmp_path, shard=0, run="run-a")
    earlier.write(200, [image("g0", 10, 1)])
    current = CheckpointStore(tmp_path, shard=0, run="run-b")
    assert current.rounds() == [] and CheckpointStore(tmp_path, shard=0).rounds() == [200]
    with pytest.raises(CheckpointError, match="belongs to run 'run-a', not to this run 'run-b'"):
        current.read(200)
    current.write(0, [image("g0", 10, 2)])  # the new run's first checkpoint removes the earlier run's
    assert current.rounds() == [0] and CheckpointStore(tmp_path, shard=0).rounds() == [0]


def test_no_checkpoint_follows_a_final_one(tmp_path):
    """A draining shard answers in-flight calls after its final checkpoint; a periodic checkpoint then would
    evict the older round the other shards hold in common with it (keep 2), and no recovery could start."""
    import asyncio

    from imerge.ps.state import BlockMeta, Shard

    async def drain() -> list[int]:
        shard = Shard(0)
        shard.checkpoints, shard.checkpoint_every = CheckpointStore(tmp_path, shard=0, keep=2), 4
        shard.expected = {"b"}
        shard.create_block(BlockMeta("b", "float32", 4, 1, SGD), torch.zeros(4))  # round 0: periodic
        block = shard.blocks["b"]
        block.rounds.round = 3  # the blocks reached round 3 when SIGTERM came
        assert await shard.final_checkpoint() == 3
        block.rounds.round = 4  # a round completed during the grace period: due, but not written
        assert shard.maybe_checkpoint() is None
        shard.close()
        return shard.checkpoints.rounds()

    assert asyncio.run(drain()) == [0, 3]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root): room for one checkpoint of a 20,000-element block, not for two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "disk"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_fails_the_write_leaves_no_temporary_folder_and_the_previous_checkpoint_stands(small_disk):
    store = CheckpointStore(small_disk, shard=0, keep=2)
    store.write(0, [image("g0", 20_000, 0)])
    with pytest.raises(Exception) as failed:  # safetensors' own error, or an OSError from the manifest
        store.write(4, [image("g0", 20_000, 4)])
    assert "No space left" in str(failed.value)
    assert [p.name for p in store.folder.iterdir()] == ["round-000000000000"]  # no .tmp-* left
    assert store.rounds() == [0] and torch.equal(store.read(0).blocks["g0"].param, image("g0", 20_000, 0).param)


@pytest.mark.timeout(300)
def test_a_job_whose_checkpoints_fail_warns_on_the_console_and_ends_after_checkpoint_failures(small_disk, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
    env.update(IMERGE_CHECKPOINT_DIR=str(small_disk), IMERGE_CHECKPOINT_EVERY="2", IMERGE_CHECKPOINT_FAILURES="2")
    run = subprocess.run([sys.executable, "-m", "imerge", "launch", "--log-dir", str(tmp_path / "logs"),
                          "--shards", "1", "--workers", "1", "--model", "digits-cnn", "--data", "digits",
                          "--iters", "400", "--no-evaluate", "--optimizer", "adam"],
                         env=env, capture_output=True, text=True, timeout=280)
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1, output
    assert "ps0: shard 0: checkpoint of round" in output and "No space left on device" in output
    assert "2 checkpoints in a row failed (--checkpoint-failures 2)" in output
    assert not [p for p in (small_disk / "shard-0").iterdir() if p.name.startswith(".tmp")]


def test_a_failed_write_is_counted_in_the_shard_metrics_and_told_to_its_listener(small_disk):
    from prometheus_client import generate_latest

    from imerge.ps.block import BlockMeta
    from imerge.ps.state import Shard

    shard = Shard(0)
    shard.checkpoints = CheckpointStore(small_disk, 0, keep=2)
    shard.expected = {"b"}  # the mapping table's blocks of this shard: round 0 is written once they exist
    told = []
    shard.on_checkpoint_failed = lambda round_, why, in_a_row: told.append((round_, in_a_row, why))
    shard.create_block(BlockMeta("b", "float32", 80_000, 2, SGD), torch.zeros(80_000))  # 320 KB: does not fit
    shard.close()  # waits for the write
    assert len(told) == 1 and told[0][:2] == (0, 1) and "No space left" in told[0][2]
    exposition = generate_latest(shard.metrics.registry).decode()
    assert 'imerge_shard_checkpoint_failures_total{shard="0"} 1.0' in exposition
    assert not list((small_disk / "shard-0").iterdir())  # nothing half-written left


def test_a_stopping_shard_waits_for_the_steps_still_running_and_starts_none():
    """A round's step may run on a data connection's thread (a daemon, never joined): the shard's close waits
    for it, since a thread inside torch when the interpreter finalizes aborts the process; after the close no
    step starts."""
    import threading

    from imerge.core.errors import Unavailable
    from imerge.ps.state import Shard

    shard, events = Shard(0, threads=2), []

    def step() -> None:
        time.sleep(0.5)
        events.append("stepped")

    running = threading.Thread(target=shard.run_arithmetic, args=(step,))
    running.start()
    time.sleep(0.1)
    shard.close()
    events.append("closed")
    running.join(5)
    assert events == ["stepped", "closed"]
    with pytest.raises(Unavailable, match="shard 0 stopped"):
        shard.run_arithmetic(step)
