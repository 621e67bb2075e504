"""The simulator (imerge simulate): its network model on cases with known answers, and that it runs the product's
own policies (the plan it simulates is the coordinator's for the same inputs)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import simpy

from imerge.core.errors import ConfigError
from imerge.core.planning import BYTES_PER_ELEMENT
from imerge.sim.cluster import GBIT, Cluster, Constants
from imerge.sim.ddp import DDPJob
from imerge.sim.fluid import Fabric, Link
from imerge.sim.profiles import ModelProfile, UnitProfile, measured, synthetic
from imerge.sim.psjob import PSJob
from imerge.sim.runner import simulate_one, strategy_schedule

FREE_DATA_PATHS = dict(shard_cpu_per_byte=0.0, worker_cpu_per_byte=0.0, grpc_shard_cpu_per_byte=0.0,
                       grpc_worker_cpu_per_byte=0.0, ddp_cpu_per_byte=0.0)
QUIET = Constants(latency_s=0.0, ring_latency_s=0.0, flag_rtt_s=0.0, incast_efficiency=1.0, **FREE_DATA_PATHS)


def finish_times(flows: list[tuple[float, list[tuple[Link, float]]]], cores: float = 0.0) -> list[float]:
    env = simpy.Environment()
    fabric = Fabric(env, cores)
    ends = [0.0] * len(flows)
    for index, (size, links) in enumerate(flows):
        done = fabric.transfer([size], links) if links else fabric.compute(size)
        done.callbacks.append(lambda _, index=index: ends.__setitem__(index, env.now))
    env.run()
    return ends


def test_one_flow_takes_its_bytes_over_the_rate():
    link = Link("l", 1e6)
    assert finish_times([(2e6, [(link, 1.0)])]) == pytest.approx([2.0])


def test_flows_on_one_link_share_it_max_min_fairly():
    link = Link("l", 1e6)
    # three flows at a third each; the small one ends at 1.5 s, the other two then share the link
    assert finish_times([(1e6, [(link, 1.0)]), (1e6, [(link, 1.0)]), (0.5e6, [(link, 1.0)])]) == \
        pytest.approx([2.5, 2.5, 1.5])


def test_a_flow_held_back_elsewhere_leaves_the_rest_to_the_others():
    shared, slow = Link("shared", 1e6), Link("slow", 0.25e6)
    assert finish_times([(0.25e6, [(shared, 1.0), (slow, 1.0)]), (0.75e6, [(shared, 1.0)])]) == \
        pytest.approx([1.0, 1.0])


def test_a_weight_stands_for_identical_flows_and_incast_cuts_an_overflowing_port():
    assert finish_times([(1e6, [(Link("l", 4e6), 4.0)])]) == pytest.approx([1.0])  # four flows of 1 MB: 1 s
    port = Link("port", 3e6, incast_senders=2, incast_efficiency=0.5)
    assert finish_times([(0.5e6, [(port, 1.0)])] * 3) == pytest.approx([1.0] * 3)  # three senders: half the rate


def test_shared_cores_slow_computations_in_proportion():
    assert finish_times([(1.0, []), (1.0, [])], cores=1.0) == pytest.approx([2.0, 2.0])
    assert finish_times([(1.0, []), (1.0, [])], cores=2.0) == pytest.approx([1.0, 1.0])


def test_the_ring_and_the_ps_each_pay_their_own_cpu_per_byte():
    profile = one_layer(1 << 22)  # 16 MB, no compute: with one core, the CPU per byte is the iteration
    cluster = Cluster(2, 2, 1000.0)
    ring_costs = dataclasses.replace(QUIET, cores=1.0, ring_cpu_per_byte=1e-8)
    ddp = simulate_one("ddp", profile, cluster, ring_costs, 8).mean_iteration_s
    assert ddp == pytest.approx(2 * profile.nbytes * 1e-8, rel=0.01)  # two ranks, M each through one core
    ps_free = simulate_one("ps-naive", profile, cluster, ring_costs, 8).mean_iteration_s
    ps_costs = simulate_one("ps-naive", profile, cluster, dataclasses.replace(ring_costs, cpu_per_byte=1e-8), 8)
    assert ps_free < 0.1 * ddp < ps_costs.mean_iteration_s


def test_the_cpu_of_a_compressed_push_follows_its_wire_bytes_its_fp32_bytes_and_its_top_k():
    profile = one_layer(1 << 22)  # 16 MB, no compute, one core: the CPU is the iteration
    cluster = Cluster(2, 2, 1000.0)

    def seconds(name: str, **costs: float) -> float:  # the median: fusion cost's first iteration waits for nothing
        return simulate_one(name, profile, cluster, dataclasses.replace(QUIET, cores=1.0, **costs), 6).median_iteration_s

    assert seconds("imerge-fp16", cpu_per_byte=1e-8) == pytest.approx(seconds("imerge", cpu_per_byte=1e-8) / 2,
                                                                       rel=0.02)  # half the wire bytes
    assert seconds("imerge-fp16", dense_cpu_per_byte=1e-8) == pytest.approx(
        seconds("imerge", dense_cpu_per_byte=1e-8), rel=0.02)  # the same fp32 bytes to cast, sum and copy
    assert seconds("imerge", topk_cpu_per_byte=1e-8) == seconds("imerge")  # no top-k, no selection
    selection = seconds("imerge-topk", topk_cpu_per_byte=1e-8)  # and the link's few milliseconds
    assert selection == pytest.approx(2 * profile.nbytes * 1e-8, rel=0.05)  # each worker's push: one core
    assert seconds("imerge-topk-pull", topk_cpu_per_byte=1e-8) == pytest.approx(1.5 * selection, rel=0.05)


def test_a_process_spends_its_cpu_per_byte_on_its_cores_across_all_its_flows():
    """On real hosts: a worker's pushes and pulls share its data path's cores; a shard's cores serve every
    worker's flows (4 workers: 4 times the bytes, 4 times the time); more cores, proportionally faster."""
    profile = one_layer(1 << 22)  # 16 MB, no compute, links far faster than any CPU: the CPU is the iteration
    nbytes, cost = profile.nbytes, 1e-9

    def seconds(name: str, workers: int, shard_cores: float = 0.0, worker_cores: float = 0.0, **costs) -> float:
        cluster = Cluster(workers, 1, 10_000.0, 10_000.0, shard_cores=shard_cores, worker_cores=worker_cores)
        return simulate_one(name, profile, cluster, dataclasses.replace(QUIET, **costs), 6).median_iteration_s

    assert seconds("ps-naive", 1, worker_cores=1, worker_cpu_per_byte=cost) == pytest.approx(2 * nbytes * cost, rel=0.02)
    assert seconds("ps-naive", 1, worker_cores=2, worker_cpu_per_byte=cost) == pytest.approx(nbytes * cost, rel=0.02)
    one = seconds("ps-naive", 1, shard_cores=1, shard_cpu_per_byte=cost)
    assert one == pytest.approx(2 * nbytes * cost, rel=0.02)
    assert seconds("ps-naive", 4, shard_cores=1, shard_cpu_per_byte=cost) == pytest.approx(4 * one, rel=0.02)
    assert seconds("ps-naive", 4, shard_cores=4, shard_cpu_per_byte=cost) == pytest.approx(one, rel=0.02)
    assert seconds("ps-naive", 4, shard_cores=0, shard_cpu_per_byte=cost) < 0.02 * one  # 0 cores: not counted
    # gRPC's data path pays its own costs; DDP's ring its own, on each byte it sends and each it receives
    assert seconds("imerge-grpc", 1, shard_cores=1, shard_cpu_per_byte=cost, grpc_shard_cpu_per_byte=3 * cost) \
        == pytest.approx(3 * seconds("imerge", 1, shard_cores=1, shard_cpu_per_byte=cost), rel=0.05)
    ring = seconds("ddp", 4, worker_cores=1, ddp_cpu_per_byte=cost)
    assert ring == pytest.approx(2 * 1.5 * nbytes * cost, rel=0.02)
    with pytest.raises(ConfigError, match="a data path's cores must be >= 0"):
        Cluster(2, 2, shard_cores=-1)


def test_shared_cores_leave_the_per_process_costs_to_the_testbed_calibration():
    profile = one_layer(1 << 22)
    testbed = dataclasses.replace(QUIET, cores=8.0, shard_cpu_per_byte=1e-6, worker_cpu_per_byte=1e-6)
    assert simulate_one("ps-naive", profile, Cluster(2, 1, 10_000.0, 10_000.0), testbed, 6).median_iteration_s < 0.01


def one_layer(numel: int, forward_s: float = 0.0, backward_s: float = 0.0) -> ModelProfile:
    return ModelProfile("one-layer", (UnitProfile("fc", numel, forward_s, backward_s),))


def test_a_sync_costs_the_comm_loop_its_cpu_once_per_shard_it_touches():
    """sync_cpu_s: a group's pull request and push stream per shard, whatever their bytes; so one group per module
    (8 groups on one shard each) costs the comm loop 8 of them, size fusion's one group on 2 shards 2."""
    profile = ModelProfile("eight", tuple(UnitProfile(f"l{u}", 1024, 0.0, 0.0) for u in range(8)))
    cluster = Cluster(1, 2, 10_000.0, 10_000.0, shard_cores=0, worker_cores=0)

    def extra(name: str) -> float:
        def seconds(sync_s: float) -> float:
            return simulate_one(name, profile, cluster, dataclasses.replace(QUIET, sync_cpu_s=sync_s),
                                6).median_iteration_s
        return seconds(1e-3) - seconds(0.0)

    assert extra("ps-naive") == pytest.approx(8e-3, rel=0.02)
    assert extra("size") == pytest.approx(2e-3, rel=0.02)


def test_one_worker_and_one_shard_take_bytes_over_rate_plus_latency_each_way():
    numel, latency = 1 << 18, 1e-3
    rate = GBIT  # 1 Gbit/s
    result = simulate_one("ps-naive", one_layer(numel), Cluster(1, 1, 1.0, 1.0),
                          dataclasses.replace(QUIET, latency_s=latency), 8)
    one_way = numel * BYTES_PER_ELEMENT / rate + latency
    assert result.mean_iteration_s == pytest.approx(2 * one_way, rel=1e-9)
    assert result.bytes_per_iteration == pytest.approx(numel * BYTES_PER_ELEMENT)


def test_a_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_model():
    numel, latency, workers = 1 << 20, 1e-4, 4
    model_bytes = numel * BYTES_PER_ELEMENT
    result = DDPJob(one_layer(numel), Cluster(workers, 1, 1.0), dataclasses.replace(QUIET, ring_latency_s=latency),
                    8, 2).run()
    assert result.bytes_per_iteration == pytest.approx(2 * (workers - 1) / workers * model_bytes)
    expected = 2 * (workers - 1) / workers * model_bytes / GBIT + 2 * (workers - 1) * latency
    assert result.mean_iteration_s == pytest.approx(expected, rel=1e-9)


def test_period_two_halves_the_bytes_per_iteration():
    profile = synthetic("resnet18-like", 32, 20.0)
    cluster = Cluster(4, 2, 10.0)
    every = simulate_one("imerge", profile, cluster, Constants(), 10)  # 8 timed iterations
    halved = simulate_one("imerge-T2", profile, cluster, Constants(), 10)
    assert halved.bytes_per_iteration == pytest.approx(every.bytes_per_iteration / 2, rel=0.01)
    assert every.bytes_per_iteration == pytest.approx(profile.nbytes, rel=0.01)


def test_a_link_bound_ps_beats_the_ring_it_is_compared_with():
    profile = one_layer(1 << 22)  # 16 MB, no compute: every strategy is link-bound
    cluster = Cluster(4, 4, 1.0)
    ddp = simulate_one("ddp", profile, cluster, QUIET, 8).mean_iteration_s
    wfbp = simulate_one("wfbp", profile, cluster, QUIET, 8).mean_iteration_s
    assert ddp == pytest.approx(1.5 * profile.nbytes / GBIT)  # the ring: 2 (W-1)/W M through each link
    # the PS: M each way per worker, the pulls of a shard's first blocks overlapping the pushes of its last
    assert profile.nbytes / GBIT < wfbp < ddp
    group = simulate_one("imerge-group", profile, cluster, QUIET, 8)
    assert group.worker_classes == 4  # one flag per (group, shard): each worker is its own class
    assert group.mean_iteration_s >= wfbp * 0.99  # the shards in turn: a block completes after every turn


def test_the_simulated_plan_is_the_one_the_coordinator_publishes(redis_url):
    from imerge.control.messages import LayoutSubmission, Profile
    from imerge.control.store import Store
    from imerge.coordinator.service import Coordinator, CoordinatorConfig
    from imerge.core.planning import layout_of
    from imerge.workloads.models import build_model

    from helpers import new_job

    profile = measured("resnet18")
    schedule = dataclasses.replace(strategy_schedule("imerge"), profile_iters=3)
    from imerge.sim.testbed import testbed_constants

    # a PS message's latency of 5 ms: fusion cost then merges units (at the testbed's 0.26 ms it keeps them apart)
    constants = dataclasses.replace(testbed_constants(), latency_s=5e-3)
    job = PSJob(profile, Cluster(3, 2, 1.0), constants, schedule, iters=6, warmup=3)
    job.run()
    assert job.published is not None and job.published.version == 2
    name = new_job()
    store = Store(redis_url, name)
    for shard in range(2):
        store.register_shard(shard, f"ps{shard}")
    layout = layout_of(build_model("resnet18"))  # the real model's parameters, as the workers submit them
    for rank in range(3):
        store.submit_layout(rank, LayoutSubmission(layout, schedule.plan_options(1000.0)))  # --link-mbps: 1 Gbit/s
    store.submit_profile(Profile(**job.submitted_profile))
    plan = Coordinator(CoordinatorConfig(job=name, redis_url=redis_url, num_workers=3, num_shards=2,
                                         wait_timeout_s=10), store).publish_plan()
    assert plan.version == 2
    assert plan.groups == job.published.groups and plan.blocks == job.published.blocks
    assert plan.units == job.published.units and len(plan.groups) < len(plan.units)


def test_a_thousand_workers_of_resnet50_simulate_in_seconds():
    result = simulate_one("imerge", synthetic("resnet50-like", 32, 20.0), Cluster(1024, 256, 25.0), Constants(), 12)
    assert result.worker_classes == 4 and result.shard_classes <= 16
    assert result.simulated_in_s < 10


def test_a_strategy_past_the_budget_is_named_with_its_estimate_and_the_rest_answer(tmp_path, capsys):
    from imerge.cli import main

    assert main(["simulate", "--model", "resnet18-like", "--workers", "16", "--shards", "4", "--iters", "5",
                 "--strategies", "imerge-group,ddp,wfbp", "--budget-s", "0.01", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report["strategies"]) == ["ddp", "wfbp"]  # the cheap ones ran (worker classes: 0 and 1)
    why = report["skipped"]["imerge-group"]
    assert why.startswith("not simulated: 16 worker classes, about ") and "--budget-s 0 simulates it" in why
    assert f"* imerge-group: {why}" in captured.out and f"imerge-group: {why}" in captured.err
    assert main(["simulate", "--model", "resnet18-like", "--workers", "16", "--shards", "4", "--iters", "5",
                 "--strategies", "imerge-group,wfbp", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    assert list(json.loads((tmp_path / "results.json").read_text())["strategies"]) == ["imerge-group", "wfbp"]
    assert main(["simulate", "--budget-s", "-1"]) == 2
    assert "--budget-s: must be >= 0" in capsys.readouterr().err


def test_a_long_simulation_says_what_it_runs_every_few_seconds():
    import time

    from imerge.sim.budget import ticking, within_budget

    said: list[str] = []
    with ticking(said.append, "simulating x", every_s=0.05):
        time.sleep(0.2)
    assert said and set(said) == {"  still simulating x: 0 s so far"} and len(said) <= 4
    said.clear()
    results, skipped = within_budget(["a", "b"], lambda name: 1, lambda name: name.upper(), 0.0, said.append)
    assert results == {"a": "A", "b": "B"} and not skipped and not said  # quick: nothing to say


def test_profiles_are_checked_and_round_trip(tmp_path):
    profile = synthetic("transformer-like", 8, 20.0)
    path = tmp_path / "p.json"
    profile.write(path)
    assert ModelProfile.read(path) == dataclasses.replace(profile, name="transformer-like")
    path.write_text(json.dumps({"format": "imerge-profile/1", "units": [["fc", 0, 0, 0.1, 0.1]]}))
    with pytest.raises(ConfigError, match="profile: .*unit #0 \\(fc\\) needs numel >= 1"):
        ModelProfile.read(path)
    for bad in ("x", -1.0, None):  # the fitted push cost: a number >= 0, or a traceback / a negative time later
        path.write_text(json.dumps({"format": "imerge-profile/1", "units": [["fc", 8, 0, 0.1, 0.1]], "alpha_s": bad}))
        with pytest.raises(ConfigError, match="alpha_s must be a finite number >= 0"):
            ModelProfile.read(path)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not an IMerge profile"):
        ModelProfile.read(path)
    merged = ModelProfile("twice", (UnitProfile("fc", 8, 0.1, 0.1), UnitProfile("fc", 8, 0.1, 0.1)))
    with pytest.raises(ConfigError, match="profile: twice: its 2 units plan as 1"):  # times would shift units
        simulate_one("wfbp", merged, Cluster(1, 1), Constants(), 4)


def test_the_command_line_reports_every_column_and_names_bad_options(tmp_path, capsys):
    from imerge.cli import main

    assert main(["simulate", "--model", "resnet18-like", "--workers", "4", "--shards", "2", "--iters", "6",
                 "--strategies", "ddp,imerge", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| strategy | mean s/it | median s/it | exposed comm s | MB/it/worker | x bound | x ddp |" in out
    assert json.loads((tmp_path / "results.json").read_text())["strategies"]["imerge"]["ratio_to_ddp"] > 0
    assert main(["simulate", "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["simulate", "--strategies", "imerge,warp"]) == 2
    assert "strategies: warp not in" in capsys.readouterr().err
    assert main(["simulate", "calibrate", "--runs", str(tmp_path / "none.json")]) == 2
    assert "runs: no such file" in capsys.readouterr().err


def test_a_simulation_opens_no_socket(monkeypatch):  # and imports no grpc or redis: .importlinter's contract
    import socket

    def refused(*args, **kwargs):
        raise AssertionError("the simulator opened a socket")

    monkeypatch.setattr(socket, "socket", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    assert simulate_one("imerge", synthetic("resnet18-like", 32, 20.0), Cluster(8, 4, 10.0), Constants(),
                        8).mean_iteration_s > 0


def test_a_worker_writes_the_profile_the_simulator_reads_and_keeps_its_period(cluster, tmp_path):
    import torch

    from test_scheduler import run_job

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    path = tmp_path / "profile.json"
    engines = run_job(cluster(2, 1), make_model, steps=4, profile_out=str(path), profile_iters=2, interleave_period=2)
    profile = ModelProfile.read(path)
    plan = engines[0].plan
    assert [(u.module, u.numel) for u in profile.units] == [(u.module, u.numel) for u in plan.units]
    assert all(u.forward_s >= 0 and u.backward_s >= 0 for u in profile.units)
    assert sum(u.forward_s for u in profile.units) > 0 and profile.compute_s > 0
    # profiling for the simulator does not sync every group as fusion cost's profile does: T = 2 holds throughout
    # (a group of phase 0 syncs in iterations 0 and 2 and at close(), one of phase 1 in iterations 1 and 3;
    # the profiled iterations 0 and 1 syncing every group would make that 4 and 3)
    assert set(engines[0].block_rounds().values()) == {2, 3}


def test_calibration_fits_the_constants_to_measured_runs(tmp_path, capsys):
    from imerge.cli import main
    from imerge.core.strategies import SCENARIOS
    from imerge.sim.calibrate import START, Case, loss

    scenario = SCENARIOS["tiny"]
    truth = dataclasses.replace(START, cores=2.0, cpu_per_byte=4e-8, latency_s=1e-3)
    measured_s = {name: simulate_one(name, measured("digits-cnn"), Cluster(2, 1, 0.1), truth,
                                     scenario.iters).iteration_s for name in ("ddp", "imerge")}
    runs = tmp_path / "results.json"  # the shape of imerge bench's results.json
    runs.write_text(json.dumps({"scenario": dataclasses.asdict(scenario), "strategies": {
        name: {"iteration_s": times, "median_iteration_s": times[0]} for name, times in measured_s.items()}}))
    assert main(["simulate", "calibrate", "--runs", str(runs), "--out", str(tmp_path / "fit")]) == 0
    fitted = Constants.read(tmp_path / "fit" / "calibration.json")
    cases = [Case(scenario, 2, name, sum(t) / len(t)) for name, t in measured_s.items()]
    assert loss(cases, fitted, 0) < loss(cases, dataclasses.replace(START, cores=fitted.cores), 0)
    assert "| digits-cnn | 2 | imerge |" in capsys.readouterr().out


def test_a_calibration_with_shared_cores_but_without_a_cpu_cost_is_refused_naming_it(tmp_path):
    from imerge.sim.testbed import testbed_constants

    assert testbed_constants().ring_cpu_per_byte > 0  # the shipped one has every cost
    old = {k: v for k, v in dataclasses.asdict(testbed_constants()).items() if k != "ring_cpu_per_byte"}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="needs ring_cpu_per_byte"):
        Constants.read(path)
    path.write_text(json.dumps(dict(old, cores=0.0)))  # without shared cores the CPU costs do not apply
    assert Constants.read(path).ring_cpu_per_byte == 0.0


def test_the_cores_sweep_recommends_the_fewest_cores_within_5_percent_of_the_free_time():
    from imerge.core.schedule_config import ScheduleConfig
    from imerge.sim.cores import cores_markdown, recommend
    from imerge.sim.projections import Task, run_task
    from imerge.sim.results import ProjectionRow
    from imerge.sim.runner import SimConfig

    def row(strategy: str, shard: float, worker: float, seconds: float, sweep: str = "cores") -> ProjectionRow:
        return ProjectionRow(sweep, "resnet50-like", 32, 16, 25.0, strategy, shard_cores=shard, worker_cores=worker,
                             mean_iteration_s=seconds, ratio_to_bound=seconds / 0.1)

    rows = [row("imerge", 0, 0, 0.10), row("imerge", 1, 1, 0.90)]
    rows += [row("imerge", c, 0, 0.10 * max(1.0, 8 / c)) for c in (1, 2, 4, 8, 16, 32, 64)]  # 8 cores reach it
    rows += [row("imerge", 0, c, 0.10 * (1 + 1 / c)) for c in (1, 2, 4, 8, 16, 32)]  # 32: 3% over; 16: 6%
    rows += [row("ddp", 0, 0, 0.08)] + [row("ddp", 0, c, 0.2) for c in (1, 2, 4, 8, 16, 32)]  # never reached
    chosen = recommend(rows)
    assert chosen[("resnet50-like", 32, 25.0, "imerge")] == (8.0, 32.0)
    assert chosen[("resnet50-like", 32, 25.0, "ddp")] == (0.0, 32.0)
    table = "\n".join(cores_markdown(rows + [row("imerge", 8, 32, 0.104, "cores-both")], ["resnet50-like"]))
    assert "| resnet50-like | 32 | 25 | imerge | 8 | 32 | 1.00 | 9.00 | 1.04 |" in table
    assert "| resnet50-like | 32 | 25 | ddp | - | 32+ | 0.80 | 2.00 | - |" in table
    # one real task of the sweep: a shard host of one core is the limit of ResNet-50 at 25 Gbit/s (a busy link
    # each way needs 2 x 3.125 GB/s x 0.28 ns = 1.75 of its cores)
    config = SimConfig(iters=4)
    free, one = (run_task(Task("cores", "resnet50-like", 32, 16, 25.0, "imerge", shard_cores=c), config,
                          ScheduleConfig(), Constants()) for c in (0.0, 1.0))
    assert one.mean_iteration_s > 1.2 * free.mean_iteration_s


def test_projections_name_an_unknown_sweep(capsys, tmp_path, monkeypatch):
    from imerge.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "projections", "--sweeps", "bound,warp"]) == 2
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    assert "sweeps: warp not in bound, incast, period, cores" in capsys.readouterr().err
