"""What the first round's wait for the script's clipping costs (docs/porting.md).

A script that clips with ``torch.nn.utils.clip_grad_norm_`` after backward makes
IMerge hold its first round until the call (the round's pushes carry the
clipping); ``model.clip_grad_norm_`` before the first backward says it in
advance and holds nothing. This runs a real job in this process (a Redis
server, the shards and the coordinator on loopback, the workers in threads)
and times, per strategy, the first two iterations (the held one, and the one
whose forward waits for it) and the mean of the later ones, the strategies
alternating over ``--rounds``:

    python scripts/bench_first_round.py --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import imerge  # noqa: E402
from helpers import LocalCluster  # noqa: E402
from imerge.ops.redis_server import RedisServer  # noqa: E402

STRATEGIES = ("clip after backward (first round held)", "model.clip_grad_norm_ in advance (nothing held)")


def model_of(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


def run(redis_url: str, strategy: str, width: int, iterations: int) -> list[float]:
    cluster = LocalCluster(redis_url, 2, 2)
    try:
        def body(rank: int) -> list[float]:
            module = model_of(width)
            optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
            model = imerge.distribute(module, optimizer, cluster.worker_config(rank))
            if strategy == STRATEGIES[1]:
                model.clip_grad_norm_(1.0)
            x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
            model(x)  # joined (the first forward's join is not timed)
            times = []
            for _ in range(iterations):
                started = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if strategy == STRATEGIES[0]:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                times.append(time.perf_counter() - started)
            model.close()
            return times

        return cluster.run_workers(body)[0]
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="hidden width (1024: 2.4 M parameters, 9.6 MB)")
    parser.add_argument("--iterations", type=int, default=8)
    args = parser.parse_args()
    results: dict[str, list[list[float]]] = {name: [] for name in STRATEGIES}
    with RedisServer() as redis:
        for _ in range(args.rounds):
            for name in STRATEGIES:
                results[name].append(run(redis.url, name, args.width, args.iterations))
    print(f"{args.rounds} rounds, width {args.width}, {args.iterations} iterations each; medians over rounds, ms")
    print(f"{'strategy':52s} {'iteration 0':>12s} {'iteration 1':>12s} {'later (mean)':>13s}")
    for name, rounds in results.items():
        first = statistics.median(r[0] for r in rounds) * 1e3
        second = statistics.median(r[1] for r in rounds) * 1e3
        later = statistics.median(statistics.mean(r[2:]) for r in rounds) * 1e3
        print(f"{name:52s} {first:12.1f} {second:12.1f} {later:13.1f}")


if __name__ == "__main__":
    main()
