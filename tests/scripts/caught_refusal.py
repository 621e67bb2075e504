"""A training script that handles its own errors, as Hydra's @hydra.main and many `try: main() except: ...` scripts
do, run by tests/test_child_processes.py under `imerge launch`: IMerge's fatal refusal must end the job naming it.

--refusal backward-twice: rank 1 runs a second backward of one forward (refused on its training thread);
--refusal lr: rank 1's learning rate differs from rank 0's (the shards refuse the round).
--handling exit1: catch, print the traceback, sys.exit(1); swallow: catch, print, and end normally.
"""
import argparse
import os
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import imerge


def main(refusal: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = imerge.distribute(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    rank = int(os.environ["RANK"])
    for iteration in range(6):
        if iteration == 2 and rank == 1 and refusal == "lr":
            optimizer.param_groups[0]["lr"] = 0.2
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        if iteration == 2 and rank == 1 and refusal == "backward-twice":
            loss.backward()
        optimizer.step()
        print("iteration", iteration, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--refusal", choices=["backward-twice", "lr"], required=True)
    parser.add_argument("--handling", choices=["exit1", "swallow"], required=True)
    args = parser.parse_args()
    try:
        main(args.refusal)
    except Exception:  # noqa: BLE001 - what such scripts do
        traceback.print_exc()
        if args.handling == "exit1":
            sys.exit(1)
    print("the script ended normally", flush=True)
