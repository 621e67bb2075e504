"""How long a shard takes to publish a round's parameters: a fresh ``bytes`` copy (``snapshot_of``, what shards did
before issue 46) against the kept buffers a dense block now publishes into (``BlockState.publish``).

    python scripts/bench_publish.py [--numel 8388608] [--rounds 3] [--repeats 15]

Each round times both ways ``--repeats`` times (the previous snapshot dropped as the next is made, as a shard's
current snapshot is replaced) and prints their medians.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from imerge.core.optim import OptimizerSpec
from imerge.ps.block import BlockMeta, BlockState, Snapshot, snapshot_of


def median_ms(publish: Callable[[], Snapshot], repeats: int) -> float:
    times, current = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        current = publish()
        times.append(time.perf_counter() - started)
    del current
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--numel", type=int, default=8_388_608, help="the block's elements (default: 33.5 MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    meta = BlockMeta("b", "float32", args.numel, 2, OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    block = BlockState(meta, torch.zeros(args.numel), "")
    for round_ in range(args.rounds):
        fresh = median_ms(lambda: snapshot_of(block.flat, meta.mode), args.repeats)
        kept = median_ms(block.publish, args.repeats)
        print(f"round {round_ + 1}: a fresh bytes copy {fresh:.1f} ms, kept buffers {kept:.1f} ms "
              f"({args.numel * 4 / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
