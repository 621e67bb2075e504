"""The CPU a shard spends on one block's round (the workers' mean, the optimizer step, the pull snapshot): the
native data plane against the Python path (torch's add, div_ and optimizer), per optimizer, one thread.

    python scripts/bench_step.py [--numel 233000] [--workers 2] [--rounds 3] [--repeats 300] [--clip 0.5]

233,000 elements is a block of ``imerge bench datapath`` (67 MB over 72 blocks). Each round runs every
optimizer on both planes, one after the other, ``--repeats`` rounds each after a warm-up (torch makes the
optimizer's state in the first), and prints the CPU milliseconds per block round. With ``--clip``, the rounds
clip by the global norm (``clip_grad_norm_``'s max_norm): the mean, its sum of squares, then the step (the
block's sum of squares is the job's).
"""
from __future__ import annotations

import argparse
import time

import torch

from imerge.control.messages import RoundScalars
from imerge.core.native import data_plane, native_available
from imerge.core.optim import OptimizerSpec
from imerge.ps.block import BlockMeta, BlockState
from imerge.ps.metrics import ShardCounters, ShardMetrics
from imerge.core.rounds import RoundOptions

OPTIMIZERS = {
    "sgd": OptimizerSpec("sgd", lr=1e-7),
    "sgd momentum, wd, nesterov": OptimizerSpec("sgd", lr=1e-7, momentum=0.9, weight_decay=1e-4, nesterov=True),
    "adam": OptimizerSpec("adam", lr=1e-7),
    "adamw": OptimizerSpec("adamw", lr=1e-7, weight_decay=0.01),
}


def cpu_ms(spec: OptimizerSpec, plane: str, numel: int, workers: int, repeats: int, clip: float = 0.0) -> float:
    block = BlockState(BlockMeta("b", "float32", numel, workers, spec), torch.randn(numel), "", data_plane(plane))
    block.grads.normal_()
    metrics, kept, options = ShardMetrics(0, ShardCounters(), 1e4), [], RoundOptions(max_norm=clip)

    def one_round() -> object:
        if not clip:
            return block.aggregate(metrics, options, set())
        mean, scalars = block.average(metrics, options)
        return block.step(metrics, mean, options, set(), RoundScalars().plus(scalars))

    for _ in range(5):
        kept = [*kept[-1:], one_round()]
    started = time.process_time()
    for _ in range(repeats):
        kept = [*kept[-1:], one_round()]  # a pull still holds the one before
    return (time.process_time() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--numel", type=int, default=233_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--clip", type=float, default=0.0, help="clip by the global norm to this (0: no clipping)")
    args = parser.parse_args()
    if args.clip < 0:
        parser.error("--clip: must be >= 0")
    if not native_available():
        parser.error("the native data plane is not built here (reinstall with a C compiler)")
    torch.set_num_threads(1)  # as a shard runs its steps
    for round_ in range(args.rounds):
        for name, spec in OPTIMIZERS.items():
            native, python = (cpu_ms(spec, plane, args.numel, args.workers, args.repeats, args.clip)
                              for plane in ("native", "python"))
            print(f"round {round_ + 1}  {name:28s} native {native:.3f} ms  python {python:.3f} ms  "
                  f"({python / native:.2f}x)")


if __name__ == "__main__":
    main()
