"""The CPU a shard spends on one checkpoint: the blocks' images (taken on the event loop) and the write (on the
checkpoint thread: the safetensors file, its CRC-32, the fsyncs, the prune of the oldest), per optimizer.

    python scripts/bench_checkpoint.py [--blocks 4] [--numel 2097152] [--repeats 10] [--dir runs]

4 blocks of 2,097,152 elements are a shard's 33.5 MB of ``imerge bench datapath``. Each block steps a few
rounds first (so that its optimizer state exists and its snapshot is published); then each repetition takes
the images of every block, writes them as ``Shard`` does, drops them and steps every block once more. Prints
the CPU milliseconds per checkpoint of the images and of the write (this process: user and system), and the
machine's busy CPU during the write and one second after it (the kernel's writeback included, wherever it ran).
"""
from __future__ import annotations

import argparse
import os
import resource
import time
import shutil
import tempfile

import torch

from imerge.core.optim import OptimizerSpec
from imerge.core.rounds import RoundOptions
from imerge.ps.block import BlockMeta, BlockState
from imerge.ps.checkpoint import CheckpointStore
from imerge.ps.metrics import ShardCounters, ShardMetrics

OPTIMIZERS = {
    "sgd": OptimizerSpec("sgd", lr=1e-7),
    "sgd momentum": OptimizerSpec("sgd", lr=1e-7, momentum=0.9),
    "adamw": OptimizerSpec("adamw", lr=1e-7, weight_decay=0.01),
}


def cpu_s() -> float:
    """This process's CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_s() -> float:
    """The machine's busy CPU seconds so far (every process and the kernel's threads: the writeback of the
    page cache may run in the flusher's threads or in the writer's fsync)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def checkpoint_ms(spec: OptimizerSpec, blocks: int, numel: int, repeats: int, folder: str
                  ) -> tuple[float, float, float]:
    """(images, write, the machine's during the write and a second after it): CPU milliseconds per checkpoint of
    ``blocks`` blocks of ``numel`` elements."""
    states = [BlockState(BlockMeta(f"b{i}", "float32", numel, 2, spec), torch.randn(numel), "d")
              for i in range(blocks)]
    metrics, options = ShardMetrics(0, ShardCounters(), 1e4), RoundOptions()

    def step_all() -> None:
        for block in states:
            block.grads.normal_()
            block.snapshot = block.aggregate(metrics, options, set())

    for _ in range(2):
        step_all()
    store = CheckpointStore(folder, 0, keep=2, run="bench")
    imaging = writing = machine = 0.0
    for round_ in range(repeats + 2):  # the first two make the kept copies and files: not counted
        started = cpu_s()
        images = [block.image() for block in states]
        taken, machine_started = cpu_s(), machine_s()
        store.write(round_, images)
        written = cpu_s()
        time.sleep(1.0)  # the flusher's share, if any, within it
        if round_ >= 2:
            imaging, writing = imaging + taken - started, writing + written - taken
            machine += machine_s() - machine_started
        del images
        step_all()
    return imaging / repeats * 1e3, writing / repeats * 1e3, machine / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--numel", type=int, default=2_097_152)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dir", default="runs", help="where the checkpoints are written (a disk, not a tmpfs)")
    args = parser.parse_args()
    megabytes = args.blocks * args.numel * 4 / 1e6
    print(f"{args.blocks} blocks of {args.numel} elements ({megabytes:.1f} MB of parameters), CPU ms per checkpoint")
    print("| optimizer | images | write | the machine, during the write and 1 s after |\n|---|---|---|---|")
    for name, spec in OPTIMIZERS.items():
        folder = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
        try:
            imaging, writing, machine = checkpoint_ms(spec, args.blocks, args.numel, args.repeats, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"| {name} | {imaging:.1f} | {writing:.1f} | {machine:.0f} |")


if __name__ == "__main__":
    main()
