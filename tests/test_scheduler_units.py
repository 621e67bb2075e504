"""Unit tests of the planner, the placement, the interleave schedule (and the purity of the recovery policy and
checkpoint modules): no grpc, no redis."""
from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from imerge.workloads.models import build_model
from imerge.core.planning import (PlanOptions, fuse_cost, fuse_none, fuse_size, layout_of, make_plan, partition,
                             predicted_end, make_units)
from imerge.core.schedule import phase, syncs
from imerge.core.queue import STOP, CommQueue

MIB = 1 << 20


def test_this_suite_imports_neither_grpc_nor_redis():
    code = ("import sys, imerge.core.planning, imerge.core.schedule, imerge.core.queue, imerge.workloads.models, "
            "imerge.coordinator.recovery, imerge.ps.checkpoint; "
            "print(sorted(m for m in ('grpc', 'redis') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def groupings(count: int):
    """Every split of units 0..count-1 into runs of consecutive units."""
    for cuts in itertools.product([False, True], repeat=count - 1):
        groups, current = [], [0]
        for unit, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(current)
                current = []
            current.append(unit)
        yield groups + [current]


@pytest.mark.parametrize("seed", range(40))
def test_cost_planner_matches_brute_force(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 7)
    ready = sorted(rng.uniform(0, 0.05) for _ in range(count))
    sizes = [rng.choice([4, 400, 40_000, 4_000_000]) for _ in range(count)]
    alpha, beta = rng.choice([0.0, 1e-4, 5e-3]), rng.choice([1e-9, 1e-8])
    best = min(predicted_end(g, ready, sizes, alpha, beta) for g in groupings(count))
    chosen = fuse_cost(ready, sizes, alpha, beta)
    assert sorted(u for g in chosen for u in g) == list(range(count))
    assert predicted_end(chosen, ready, sizes, alpha, beta) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_cost_planner_degenerate_cases():
    ready, sizes = [0.01 * i for i in range(1, 7)], [1000] * 6
    assert fuse_cost(ready, sizes, 0.0, 1e-9) == fuse_none(sizes)  # free messages: no merging needed
    assert fuse_cost(ready, sizes, 10.0, 1e-9) == [list(range(6))]  # expensive messages: one group
    assert fuse_cost([], [], 1.0, 1.0) == []


def test_size_planner_has_a_small_first_group_and_a_cap():
    sizes = [300_000] * 10
    groups = fuse_size(sizes, cap_bytes=1_000_000, first_cap_bytes=400_000)
    assert groups[0] == [0]
    assert all(sum(sizes[u] for u in g) <= 1_000_000 for g in groups)
    assert [u for g in groups for u in g] == list(range(10))
    assert fuse_size([5_000_000, 10], 1_000_000, 1_000_000) == [[0], [1]]  # an oversized unit stands alone


def test_partitions_split_large_units_evenly():
    units = make_units(layout_of(build_model("vgg")))
    blocks = partition(units, 4 * MIB)
    assert all(b.numel * 4 <= 4 * MIB for b in blocks)
    assert sum(b.numel for b in blocks) == sum(u.numel for u in units)
    assert all(a.offset + a.numel == b.offset for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_a_split_unit_lies_evenly_on_every_shard(shards):
    """Two 16 MB layers in 4 MiB partitions were 8 blocks, which 3 shards held 3/3/2; now each split unit is a
    multiple of the shard count, and the busiest shard holds at most the largest unsplit unit above the mean."""
    layout = layout_of(build_model("vgg"))
    units = make_units(layout)
    blocks = partition(units, 4 * MIB, shards)
    for unit in units:
        parts = [b for b in blocks if b.unit == unit.index]
        assert len(parts) == 1 or len(parts) % shards == 0
    plan = make_plan(layout, 2, [f"s{i}" for i in range(shards)], 1, PlanOptions(partition_bytes=4 * MIB))
    load = [plan.shard_bytes(s) for s in range(shards)]
    largest_unsplit = max(u.numel * 4 for u in units if u.numel * 4 <= 4 * MIB)
    assert max(load) - sum(load) / shards <= largest_unsplit


def test_interleave_schedule():
    for period in (1, 2, 4):
        for group in range(9):
            iterations = [k for k in range(20) if syncs(group, k, period)]
            assert iterations[0] == phase(group, period)
            assert all(b - a == period for a, b in zip(iterations, iterations[1:]))
    assert [phase(g, 4) for g in range(5)] == [0, 3, 2, 1, 0]


def test_comm_queue_priority_and_fifo():
    for priority, expected in ((True, [7, 3, 2, 0]), (False, [2, 0, 7, 3])):
        queue = CommQueue(priority)
        for index in (2, 0, 7, 3):
            queue.put(index, index)
        assert [queue.pop() for _ in range(4)] == expected


@pytest.mark.parametrize("priority", [True, False])
def test_the_stop_item_is_taken_after_every_queued_sync(priority):
    """The worker's comm loop and the simulator's stop their consumer with the same item, taken last either way."""
    queue = CommQueue(priority)
    queue.put(1, "a")
    queue.put(STOP, None)
    queue.put(0, "b")  # queued after the stop was asked for, as a sync of a closing worker may be
    assert [queue.pop() for _ in range(3)] == (["a", "b", None] if priority else ["a", None, "b"])
    queue.put(5, "c")
    queue.put(STOP, None)
    assert [queue.pop() for _ in range(2)] == ["c", None]


def imbalance(plan) -> list[float]:
    load = plan.shard_load()
    return [max(col) / min(col) for col in zip(*load)]


@pytest.mark.parametrize("period", [1, 2])
def test_resnet18_placement_balanced_per_phase(period):
    layout = layout_of(build_model("resnet18"))
    shards = ["a:1", "b:1", "c:1"]
    lpt = make_plan(layout, 3, shards, 1, PlanOptions(period=period))
    rr = make_plan(layout, 3, shards, 1, PlanOptions(period=period, placement="round-robin"))
    print(f"T={period}: largest/smallest shard bytes per phase: lpt {[round(r, 3) for r in imbalance(lpt)]}, "
          f"round-robin {[round(r, 3) for r in imbalance(rr)]}")
    assert max(imbalance(lpt)) <= 1.10
    assert max(imbalance(rr)) > max(imbalance(lpt))
