"""Pure policy and codec units: no grpc, no redis."""
from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from imerge.core.codec import ChunkAssembler, tensor_view
from imerge.core.config import CommonConfig, from_env, to_env
from imerge.core.errors import ConfigError, InvalidArgument, LayoutMismatchError, PlanError
from imerge.core.planning import Layout, ParamInfo, Plan, PlanOptions, make_plan, make_units, place


def layout(*specs) -> Layout:
    return Layout(tuple(ParamInfo(name, shape, module) for name, shape, module in specs))


def test_policy_modules_import_neither_grpc_nor_redis():
    code = ("import sys, imerge.core.planning, imerge.core.codec, imerge.core.config, imerge.core.optim; "
            "print(sorted(m for m in ('grpc', 'redis') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_units_follow_modules_in_backward_order():
    units = make_units(layout(("fc.bias", (10,), "fc"), ("fc.weight", (10, 4), "fc"),
                              ("conv.weight", (4, 1, 3, 3), "conv")))
    assert [(u.index, u.module, u.offset, u.numel) for u in units] == [(0, "fc", 0, 50), (1, "conv", 50, 36)]


def test_no_unit_or_block_straddles_two_parameter_groups():
    """A module whose weight decays and whose bias does not is two units, so its blocks hold one group each."""
    params = (ParamInfo("fc.bias", (10,), "fc", 1), ParamInfo("fc.weight", (10, 400), "fc", 0),
              ParamInfo("norm.bias", (400,), "norm", 1), ParamInfo("norm.weight", (400,), "norm", 1))
    plan = make_plan(Layout(params), 2, ["a", "b"], 1, PlanOptions(partition_bytes=4096))
    assert [(u.module, u.group, u.numel) for u in plan.units] == [("fc", 1, 10), ("fc", 0, 4000), ("norm", 1, 800)]
    ranges = {0: (10, 4010), 1: (0, 10)}
    for block in plan.blocks:
        group = plan.units[block.unit].group
        start, end = ranges.get(group) if plan.units[block.unit].module == "fc" else (4010, 4810)
        assert start <= block.offset and block.offset + block.numel <= end
    assert Layout.from_json(Layout(params).to_json()) == Layout(params)


@pytest.mark.parametrize("sizes, shards", [([5, 3, 3, 2, 2, 1], 2), ([7, 7, 7], 3), ([10, 1, 1, 1], 2), ([4], 3)])
def test_greedy_placement_is_lpt_and_within_four_thirds_of_optimum(sizes, shards):
    placement = place(sizes, [0] * len(sizes), shards, 1)
    load = [sum(s for s, p in zip(sizes, placement) if p == shard) for shard in range(shards)]
    best = min(max(sum(s for s, p in zip(sizes, assign) if p == shard) for shard in range(shards))
               for assign in itertools.product(range(shards), repeat=len(sizes)))
    assert max(load) <= 4 / 3 * best + 1e-9
    assert sum(load) == sum(sizes)


def test_placement_needs_a_shard():
    with pytest.raises(PlanError):
        place([1], [0], 0, 1)


def test_plan_round_trips_through_json():
    plan = make_plan(layout(("a", (3,), "m1"), ("b", (5, 2), "m2")), 2, ["h:1", "h:2"], version=4)
    assert Plan.from_json(plan.to_json()) == plan
    assert sorted(plan.shard_load()) == [[12], [40]]


def test_layout_mismatch_messages():
    base = layout(("a", (3,), "m"), ("b", (2,), "m"))
    with pytest.raises(LayoutMismatchError, match=r"worker 2 disagrees with worker 0 at parameter #1: b \[3\] vs b \[2\]"):
        base.check_same(layout(("a", (3,), "m"), ("b", (3,), "m")), 0, 2)
    with pytest.raises(LayoutMismatchError, match="first extra one \\(worker 1\\): c"):
        base.check_same(layout(("a", (3,), "m"), ("b", (2,), "m"), ("c", (1,), "m")), 0, 1)


def test_chunks_round_trip_and_limits():
    source = torch.arange(1000, dtype=torch.float32)
    target = torch.empty(1000)
    assembler = ChunkAssembler(target, "t")
    view = tensor_view(source)
    for start in range(0, len(view), 512):
        assembler.feed(view[start:start + 512])
    assembler.finish()
    assert torch.equal(source, target)
    with pytest.raises(InvalidArgument, match="more than the declared"):
        ChunkAssembler(torch.empty(2), "t").feed(np.zeros(3, "<f4").tobytes())
    with pytest.raises(InvalidArgument, match="truncated"):
        ChunkAssembler(torch.empty(2), "t").finish()


def test_config_from_env_and_back():
    config = from_env(CommonConfig, {"IMERGE_JOB": "j1", "IMERGE_WAIT_TIMEOUT_S": "3.5"})
    assert (config.job, config.wait_timeout_s) == ("j1", 3.5)
    assert from_env(CommonConfig, to_env(config)) == config
    with pytest.raises(ConfigError, match="IMERGE_WAIT_TIMEOUT_S"):
        from_env(CommonConfig, {"IMERGE_WAIT_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="--job"):
        CommonConfig(job="a:b")
    with pytest.raises(ConfigError, match="--log-level"):
        CommonConfig(log_level="LOUD")


def test_worker_identity_from_torchrun_variables():
    from imerge.worker.config import WorkerConfig

    config = from_env(WorkerConfig, {"RANK": "2", "WORLD_SIZE": "3"})
    assert (config.rank, config.world_size) == (2, 3)
    assert from_env(WorkerConfig, {"RANK": "2", "WORLD_SIZE": "3", "IMERGE_RANK": "1"}).rank == 1
    with pytest.raises(ConfigError, match="--rank"):
        from_env(WorkerConfig, {"RANK": "3", "WORLD_SIZE": "3"})


def test_recovery_picks_the_newest_round_every_shard_holds_and_ignores_old_reports():
    from imerge.control.messages import FailureReport as Failure
    from imerge.coordinator.recovery import RecoveryImpossible, RecoveryPolicy, common_round

    assert common_round({0: [8, 12], 1: [4, 8]}, 2) == 8
    assert common_round({0: [8, 12]}, 2) is None  # shard 1 published nothing
    assert common_round({0: [12], 1: [8]}, 2) is None
    policy = RecoveryPolicy(num_shards=2, max_recoveries=2)
    assert policy.next_generation(Failure(0, "shard 1", "gone"), {0: [8, 12], 1: [4, 8]}) == (1, 8)
    assert policy.next_generation(Failure(0, "worker 0", "its call failed"), {0: [8], 1: [8]}) is None
    assert policy.next_generation(Failure(1, "worker 1", "died"), {0: [8], 1: [8]}) == (2, 8)
    with pytest.raises(RecoveryImpossible, match=r"worker 1: died; the job already recovered 2 times"):
        policy.next_generation(Failure(2, "worker 1", "died"), {0: [8], 1: [8]})
    with pytest.raises(RecoveryImpossible, match="no checkpoint round is complete on every shard"):
        RecoveryPolicy(num_shards=2).next_generation(Failure(0, "shard 0", "gone"), {0: [4], 1: []})
    with pytest.raises(RecoveryImpossible, match="needs --interleave-period 1"):
        RecoveryPolicy(num_shards=1, period=2).next_generation(Failure(0, "shard 0", "gone"), {0: [4]})
    with pytest.raises(RecoveryImpossible, match=r"shard 0: gone \(recovery is off\)"):
        RecoveryPolicy(num_shards=1, enabled=False).next_generation(Failure(0, "shard 0", "gone"), {0: [4]})
    with pytest.raises(RecoveryImpossible, match=r"worker 1: bad push \(a fatal error"):  # fatal: never recovered
        RecoveryPolicy(num_shards=1).next_generation(Failure(0, "worker 1", "bad push", fatal=True), {0: [4]})


# -- the shards' agreement on a round's scalars (services/ps/rounds.py) -------------------------------------
def test_every_block_of_a_round_steps_with_the_same_totals_of_every_shard():
    from imerge.control.messages import RoundScalars
    from imerge.ps.rounds import Agreements

    async def scenario():
        async def exchange(round_, mine):  # another shard contributes 4.0 and an inf
            return mine.plus(RoundScalars(4.0, round_ == 8))
        agreements = Agreements(exchange)
        expected = {"a", "b"}
        first = await asyncio.gather(agreements.agree(7, "a", RoundScalars(1.0), expected),
                                     agreements.agree(7, "b", RoundScalars(2.0), expected))
        second = await asyncio.gather(agreements.agree(8, "b", RoundScalars(0.5), expected),
                                      agreements.agree(8, "a", RoundScalars(0.5), expected))
        return first, second

    first, second = asyncio.run(scenario())
    assert first == [RoundScalars(7.0, False)] * 2 and second == [RoundScalars(5.0, True)] * 2
    assert second[0].grad_norm == float("inf") and first[0].grad_norm == pytest.approx(7.0 ** 0.5)


def test_a_failed_exchange_fails_every_block_of_the_round_and_a_second_report_is_refused():
    from imerge.core.errors import FailedPrecondition, WaitTimeout
    from imerge.control.messages import RoundScalars
    from imerge.ps.rounds import Agreements

    async def scenario():
        async def exchange(round_, mine):
            raise WaitTimeout("timed out waiting for shards [1] to post their scalars of round 3")
        agreements = Agreements(exchange)
        results = await asyncio.gather(agreements.agree(3, "a", RoundScalars(1.0), {"a", "b"}),
                                       agreements.agree(3, "b", RoundScalars(1.0), {"a", "b"}),
                                       return_exceptions=True)
        waiting = asyncio.ensure_future(agreements.agree(4, "a", RoundScalars(1.0), {"a", "b"}))
        await asyncio.sleep(0)
        with pytest.raises(FailedPrecondition, match="block a reported round 4's scalars twice"):
            await agreements.agree(4, "a", RoundScalars(1.0), {"a", "b"})
        waiting.cancel()
        return results

    results = asyncio.run(scenario())
    assert [type(r) for r in results] == [WaitTimeout, WaitTimeout]
    assert all("shards [1] to post their scalars of round 3" in str(r) for r in results)


def test_a_restore_forgets_the_rounds_awaiting_agreement():
    """After reset (a restore replaced the blocks), the restored blocks report the same round afresh: neither
    refused as reported twice nor summed with the scalars of the blocks they replaced."""
    from imerge.control.messages import RoundScalars
    from imerge.ps.rounds import Agreements

    async def scenario():
        agreements = Agreements()
        stale = asyncio.ensure_future(agreements.agree(5, "a", RoundScalars(100.0), {"a", "b"}))
        await asyncio.sleep(0)
        agreements.reset()
        with pytest.raises(asyncio.CancelledError):
            await stale
        return await asyncio.gather(agreements.agree(5, "a", RoundScalars(1.0), {"a", "b"}),
                                    agreements.agree(5, "b", RoundScalars(2.0), {"a", "b"}))

    assert asyncio.run(scenario()) == [RoundScalars(3.0, False)] * 2


def test_pace_tells_a_dripping_stream_from_a_slow_honest_one():
    from imerge.ps.pace import Pace

    now = [0.0]

    def stream(bytes_per_step: int, steps: int) -> Pace:
        now[0] = 0.0
        pace = Pace(1000.0, 2.0, lambda: now[0])
        for _ in range(steps):
            now[0] += 0.3
            pace.moved(bytes_per_step)
        return pace

    young = stream(4, 5)  # 1.5 s: younger than the window, never too slow yet; silent for nothing
    assert not young.too_slow() and not young.stalled(2.0)
    dripping = stream(4, 20)  # 6 s of 4 bytes every 0.3 s
    assert "moved" in dripping.too_slow() and dripping.stalled(1.0)
    honest = stream(400, 20)  # 1,333 bytes/s, above the minimum
    assert not honest.too_slow() and not honest.stalled(1.0)
    now[0] += 1.0  # then silent for a second: stalled
    assert honest.stalled(1.0) and honest.idle_for() == 1.0
    assert not Pace(0.0, 2.0, lambda: now[0]).too_slow()  # no minimum


def test_the_automatic_partition_is_the_power_of_two_nearest_8_ms_of_the_link_between_64_kib_and_8_mib():
    from imerge.core.planning import auto_partition_bytes
    from imerge.core.schedule_config import MIB, ScheduleConfig

    assert [auto_partition_bytes(mbps) for mbps in (1, 10, 100, 1000, 1500, 2000, 10000, 25000)] == \
        [64 << 10, 64 << 10, 128 << 10, MIB, 2 * MIB, 2 * MIB, 8 * MIB, 8 * MIB]
    assert ScheduleConfig().plan_options(100).partition_bytes == 128 << 10
    assert ScheduleConfig().plan_options().partition_bytes == 8 * MIB  # --link-mbps's default, 10 Gbit/s
    assert ScheduleConfig(partition_mib=2).plan_options(100000).partition_bytes == 2 * MIB  # given: kept
    with pytest.raises(ConfigError, match="--partition-mib.*or 0: from --link-mbps"):
        ScheduleConfig(partition_mib=-1)
    for name in ("partition_mib", "size_cap_mib", "first_cap_mib"):  # a size of inf: a message, not a traceback
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}.*finite"):
            ScheduleConfig(**{name: float("inf")})
