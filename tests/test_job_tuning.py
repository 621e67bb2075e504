"""--tune: a job chooses its own schedule at the plan switch, from worker 0's profile, by simulating candidates.

What the user gives pins a knob; the decision travels in plan v2 and every worker applies it at the same
iteration; at T = 1 whatever it chooses leaves the parameters bit-identical to the schedule as given.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch
from prometheus_client import generate_latest

import imerge
from imerge.control.messages import LayoutSubmission, Profile
from imerge.core.config import explicit_fields
from imerge.core.errors import ConfigError, PlanError, StoreError
from imerge.core.knobs import JOB_KNOBS, KNOBS
from imerge.core.planning import COST_PLAN, FIRST_PLAN, Layout, ParamInfo, Plan, PlanOptions, make_plan
from imerge.core.schedule_config import ScheduleConfig
from imerge.sim.jobtune import decide, job_cluster
from imerge.sim.tuning import MARGIN
from imerge.workloads.models import build_model

from test_equivalence import OPTIMIZERS, WORKERS, batches

# -- what pins a knob ----------------------------------------------------------------------------
def test_auto_frees_the_knobs_no_option_gives_and_never_fusion_with_t_above_one():
    assert ScheduleConfig().tuned(set()).tune == "fusion,priority,slots"
    assert ScheduleConfig(fusion="none").tuned({"fusion"}).tune == "priority,slots"  # the default given: pinned
    assert ScheduleConfig().tuned({"slot_width"}).tune == "fusion,priority"  # one field of a knob pins it
    assert ScheduleConfig(interleave_period=2).tuned(set()).tune == "priority,slots"
    assert ScheduleConfig().tuned({"fusion", "priority", "slots"}).tune == "none"
    assert ScheduleConfig(tune="priority").tuned(set()).tune == "priority"  # a resolved value is kept
    # a config built in code, never resolved: the fields that differ from their defaults pin
    assert ScheduleConfig(fusion="size").plan_options().tune == "priority,slots"
    assert ScheduleConfig(tune="none").plan_options().tune == ""
    assert not ScheduleConfig(tune="none", fusion="size").plan_options().switches
    assert ScheduleConfig(tune="none", fusion="cost").plan_options().switches


def test_an_option_in_the_environment_pins_like_a_flag():
    env = {"IMERGE_FUSION": "size", "IMERGE_TRACE_DIR": "", "IMERGE_PRIORITY": "0"}
    assert explicit_fields(ScheduleConfig, {"slots", "not_a_field"}, env) == {"fusion", "priority", "slots"}


@pytest.mark.parametrize("value", ["bogus", "fusion,partition", ",", "auto,none"])
def test_a_tune_value_out_of_its_knobs_is_refused_naming_the_option(value):
    with pytest.raises(ConfigError, match="--tune") as raised:
        ScheduleConfig(tune=value)
    assert "fusion, priority, slots" in str(raised.value)
    with pytest.raises(PlanError, match="partition"):
        PlanOptions(tune="fusion,partition").validate()


def test_the_decision_travels_in_the_plan_and_the_schedule_in_the_layout():
    layout = Layout((ParamInfo("a", (300,), "a"), ParamInfo("b", (500,), "b")))
    plan = make_plan(layout, 2, ["s0:1"], FIRST_PLAN)
    tuned = Plan(**{**plan.__dict__, "knobs": (("fusion", "size"), ("priority", "off")), "predicted_s": 0.25})
    assert Plan.from_json(tuned.to_json()) == tuned
    assert Plan.from_json(json.dumps({k: v for k, v in json.loads(plan.to_json()).items()
                                      if k not in ("knobs", "predicted_s")})) == plan  # an older plan: not tuned
    worker = ScheduleConfig(fusion="size", trace_dir="/tmp", profile_out="")
    sent = LayoutSubmission.decode(LayoutSubmission(layout, worker.plan_options(), worker).encode())
    assert sent.schedule == ScheduleConfig(fusion="size")  # host-local paths stay on the worker's host
    broken = json.loads(LayoutSubmission(layout, worker.plan_options(), worker).encode())
    broken["schedule"]["slots"] = "sometimes"
    with pytest.raises(StoreError, match="schedule"):
        LayoutSubmission.decode(json.dumps(broken))
    with pytest.raises(StoreError, match="forward times"):
        Profile.decode(json.dumps(dict(ready_s=[0.1, 0.2], unit_bytes=[4, 4], alpha_s=0.0, beta_s_per_byte=0.0,
                                       forward_s=[0.1])))


def test_the_decision_varies_only_the_tuned_knobs_and_tries_flags_only_against_a_port_queue():
    """A model of four units (the suite's small CNN's sizes) on one shard behind a 100 Mbit/s link: against a
    shallow port queue three workers' pushes overflow it, so the tuner takes port flags and fewer, larger groups;
    without a queue it tries no flags."""
    sizes = [40, 2560, 10240, 131072]
    layout = Layout(tuple(ParamInfo(f"m{u}", (n // 4,), f"m{u}") for u, n in enumerate(sizes)))
    plan = make_plan(layout, 3, ["s0:1"], FIRST_PLAN)
    profile = Profile(ready_s=[1e-3 * (u + 1) for u in range(4)], unit_bytes=sizes, alpha_s=1e-3,
                      beta_s_per_byte=1e-8, forward_s=[1e-3] * 4)
    every = PlanOptions(tune="fusion,priority,slots")
    only = decide(profile, plan, PlanOptions(tune="priority"), ScheduleConfig(tune="none"), queue_kb=2)
    assert set(only.knobs) == {"priority"} and "fusion" in only.report.pinned
    chosen = decide(profile, plan, every, ScheduleConfig(tune="none"), link_gbit=0.1, queue_kb=2)
    assert chosen.knobs["slots"] == "port" and chosen.knobs["fusion"] == "size", chosen.report
    fastest = min(t.mean_iteration_s for t in chosen.report.trials)  # a tie within the margin keeps the given value
    assert chosen.report.runner_up and chosen.report.chosen.mean_iteration_s <= fastest * (1 + MARGIN)
    unqueued = decide(profile, plan, every, ScheduleConfig(tune="none"), link_gbit=0.1)
    assert "slots" not in unqueued.knobs and unqueued.report.skipped
    assert all(value in KNOBS[knob] for knob, value in chosen.knobs.items()) and set(chosen.knobs) <= set(JOB_KNOBS)
    assert job_cluster(profile, plan, 0, 0).worker_gbit == pytest.approx(0.8)  # the pushes' rate: 1 / beta
    assert job_cluster(profile, plan, 25, 16).worker_gbit == 25 and job_cluster(profile, plan, 25, 16).queue_kb == 16


def test_a_fusion_cost_candidate_is_simulated_with_the_groups_the_job_would_run():
    """The job's cost plan groups the units by worker 0's measured ready times and push cost; the tuner's fusion
    cost candidate must be simulated with those groups, not with a cost plan of the simulated pushes (whose push
    cost is the calibration's, here 50 times cheaper: it would keep every unit apart)."""
    from imerge.sim.cluster import Cluster, Constants
    from imerge.sim.jobtune import decided_plan, job_profile
    from imerge.sim.psjob import PSJob

    sizes = [4096, 8192, 8192, 16384]
    layout = Layout(tuple(ParamInfo(f"m{u}", (n // 4,), f"m{u}") for u, n in enumerate(sizes)))
    options = PlanOptions(fusion="cost")
    first = make_plan(layout, 2, ["s0:1"], FIRST_PLAN, options)
    profile = Profile(ready_s=[2e-3 * (u + 1) for u in range(4)], unit_bytes=sizes, alpha_s=5e-3,
                      beta_s_per_byte=1e-9, forward_s=[1e-3] * 4)
    expected = decided_plan(layout, options, first, profile, {}, {}, COST_PLAN)
    cluster, schedule = Cluster(2, 1, 10.0, 10.0), ScheduleConfig(fusion="cost", tune="none", profile_iters=2)

    def published(model) -> list:
        job = PSJob(model, cluster, Constants(latency_s=5e-5), schedule, 6, 3)
        job.run()
        return [g.units for g in job.published.groups]

    model = job_profile(profile, first)
    assert published(model) == [g.units for g in expected.groups] and len(expected.groups) < 4
    assert published(dataclasses.replace(model, cost_groups=None)) != published(model)  # the simulated pushes' plan


def test_a_profile_measured_on_shared_cores_is_taken_back_to_the_simulators_alone_times():
    """On the testbed every process shares the machine's cores: worker 0's profile holds the contention of the
    others, which the simulator adds again. Measured as the simulator says a job of the alone-times would run,
    the profile comes back to those alone-times; on real hosts (no shared cores) it is kept as measured."""
    from imerge.sim.cluster import Cluster, Constants
    from imerge.sim.jobtune import uncontended
    from imerge.sim.profiles import measured
    from imerge.sim.testbed import testbed_constants
    from imerge.sim.tuning import simulate_schedule

    alone, cluster, shared = measured("resnet18"), Cluster(3, 3, 1.0), testbed_constants()
    schedule = ScheduleConfig(tune="none")
    run = simulate_schedule(alone, cluster, shared, schedule)
    as_measured = alone.scaled(run.mean_iteration_s - run.exposed_comm_s)  # what worker 0's clock would read
    assert as_measured.compute_s > 1.3 * alone.compute_s  # three workers' compute on two cores
    recovered = uncontended(as_measured, cluster, shared, schedule)
    assert recovered.compute_s == pytest.approx(alone.compute_s, rel=0.05)
    # --fusion cost: the profile was measured on plan v1 (one group per module), not on the cost plan after it
    cost = dataclasses.replace(schedule, fusion="cost")
    assert uncontended(as_measured, cluster, shared, cost).compute_s == pytest.approx(alone.compute_s, rel=0.05)
    assert uncontended(as_measured, cluster, Constants(), schedule) is as_measured


@pytest.mark.unit
def test_the_profiler_times_each_profiled_iteration_but_the_first_from_its_forward_to_the_next():
    import time

    from imerge.worker.profiler import Profiler

    profiler = Profiler(1)
    assert profiler.iteration_time() == 0.0  # nothing profiled
    for seconds in (0.2, 0.05, 0.1):  # the first (warm-up) not counted
        profiler.forward_started()
        profiler.backward_started(time.monotonic())
        time.sleep(seconds)
        profiler.backward_ended()
    assert profiler.iteration_time() == pytest.approx(0.075, abs=0.02)
    assert profiler.summary([4]).iteration_s == profiler.iteration_time()


def test_a_profile_is_anchored_on_the_iteration_time_it_measured_where_the_compute_reads_beyond_the_model():
    """A worker's compute can read slower than the model's contention makes it (its comm thread holds the
    interpreter the hooks need: VGG's profile reads 7x its alone-time on the testbed, the model gives 4x). With
    the profiled iteration's time, the profile is scaled until the simulated iteration takes it; where no scale
    reaches it (an iteration time the links alone exceed), the compute is matched as before."""
    from imerge.sim.cluster import Cluster
    from imerge.sim.jobtune import uncontended
    from imerge.sim.profiles import measured
    from imerge.sim.testbed import testbed_constants
    from imerge.sim.tuning import simulate_schedule

    alone, cluster, shared = measured("vgg"), Cluster(3, 3, 1.0), testbed_constants()
    schedule = ScheduleConfig(tune="none")
    run = simulate_schedule(alone, cluster, shared, schedule)
    slow_clock = alone.scaled(2 * (run.mean_iteration_s - run.exposed_comm_s))  # twice what the model gives
    by_compute = uncontended(slow_clock, cluster, shared, schedule)
    assert by_compute.compute_s > 1.5 * alone.compute_s  # the compute anchor takes the excess for work
    anchored = uncontended(slow_clock, cluster, shared, schedule, run.mean_iteration_s)
    assert anchored.compute_s == pytest.approx(alone.compute_s, rel=0.1)
    unreachable = uncontended(slow_clock, cluster, shared, schedule, run.mean_iteration_s / 10)
    assert unreachable.compute_s == by_compute.compute_s


# -- a real job --------------------------------------------------------------------------------------
def _run(c, data, keywords: bool = False, **options) -> list[dict[str, torch.Tensor]]:
    """The job on cluster ``c``: each worker's config built in code, or (``keywords``) from imerge.distribute's
    keywords, as a script passes them."""
    models = [build_model("digits-cnn", seed=0) for _ in range(WORKERS)]

    def body(rank: int):
        if keywords:
            model = imerge.distribute(models[rank], OPTIMIZERS["sgd"], job=c.job, redis_url=c.redis_url, rank=rank,
                                      world_size=WORKERS, wait_timeout_s=60, **options)
        else:
            model = imerge.distribute(models[rank], OPTIMIZERS["sgd"], c.worker_config(rank, **options))
        with model:
            for step in data:
                x, y = step[rank]
                torch.nn.functional.cross_entropy(model(x), y).backward()
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    return c.run_workers(body)


def test_a_job_switches_to_the_schedule_it_chose_and_computes_bit_for_bit_what_the_given_one_does(cluster, caplog):
    """The coordinator is told the shard sits behind a 1 Mbit/s link with a 2 kB port queue: three workers' pushes
    overflow it, so the tuner takes slot flags, and the workers really take them from the switch on (whatever it
    chose of fusion and priority as well); the parameters equal, bit for bit, those of the schedule as given
    (--tune none: one group per module, no flags)."""
    from imerge.coordinator.metrics import coordinator_registry

    caplog.set_level(logging.INFO, "imerge.telemetry.progress")
    data = batches()
    tuned = cluster(WORKERS, 1, coordinator_options=dict(link_gbit=0.001, queue_kb=2))
    results = _run(tuned, data, profile_iters=3)
    plan = tuned.coordinator.plan
    assert plan is not None and plan.version == COST_PLAN and plan.predicted_s > 0
    knobs = dict(plan.knobs)
    assert knobs["slots"] != "off" and set(knobs) == {"fusion", "priority", "slots"}, knobs
    scraped = generate_latest(coordinator_registry(tuned.coordinator.store, (WORKERS, 1), 1000.0,
                                                   lambda: tuned.coordinator.plan, lambda: 0)).decode()
    assert f"imerge_schedule_predicted_seconds {plan.predicted_s}" in scraped
    for role, count in (("worker", WORKERS), ("shard", 1)):  # the plan's members, the alerts' reference
        assert f'imerge_coordinator_expected_{role}s {count:.1f}' in scraped
    assert (f'imerge_schedule_info{{fusion="{knobs["fusion"]}",priority="{knobs["priority"]}",'
            f'slots="{knobs["slots"]}"}} 1.0') in scraped
    assert plan.runner_up and plan.runner_up_s >= plan.predicted_s * (1 - MARGIN)  # a tie keeps the one in use
    reported = [r.getMessage() for r in caplog.records if "event=schedule" in r.getMessage()]
    assert len(reported) == 1 and f"predicted_s={plan.predicted_s:.4g}" in reported[0], reported  # worker 0 only
    profiled = re.search(r"profile_compute_s=([0-9.e-]+)", reported[0])
    assert profiled and float(profiled.group(1)) > 0, reported  # the profile's compute it was decided on
    granted = [line for line in scraped.splitlines() if line.startswith("imerge_coordinator_flags_granted_total")]
    assert granted and float(granted[0].split()[-1]) > 0, scraped  # the workers took flags after the switch

    given = cluster(WORKERS, 1)
    expected = _run(given, data, profile_iters=3, tune="none")
    assert given.coordinator.plan.version == FIRST_PLAN and len(given.coordinator.plan.groups) == 4
    assert "imerge_schedule_info" not in generate_latest(coordinator_registry(
        given.coordinator.store, (WORKERS, 1), 1000.0, lambda: given.coordinator.plan, lambda: 0)).decode()
    for worker, params in enumerate(results):
        for name, value in expected[0].items():
            assert torch.equal(params[name], value), f"worker {worker}, {name} differs after the switch"


def test_a_pinned_knob_is_kept_and_a_job_shorter_than_its_profile_ends_on_the_first_plan(cluster):
    data = batches()
    pinned = cluster(WORKERS, 1)
    _run(pinned, data[:6], keywords=True, profile_iters=3, fusion="none", priority=False)  # given, default or not
    # the one free knob, slots, is not tried without a port queue: nothing to choose, the schedule as given
    assert pinned.coordinator.plan.version == COST_PLAN and pinned.coordinator.plan.knobs == ()
    short = cluster(WORKERS, 1)
    _run(short, data[:2], profile_iters=3)
    short._thread.join(30)
    assert short.coordinator_result == [0] and short.coordinator.plan.version == FIRST_PLAN



def test_the_launcher_and_the_benchmark_say_what_was_chosen_and_what_it_predicted():
    from imerge.bench.report import markdown
    from imerge.bench.runner import decision_fields, summarize
    from imerge.core.bench_results import RunResult
    from imerge.core.strategies import SCENARIOS
    from imerge.ops.launch import schedule_line

    event = {"event": "schedule", "iteration": 5, "knobs": {"fusion": "size", "priority": "on"},
             "predicted_s": 1.23456, "runner_up": {"fusion": "none", "priority": "on"}, "runner_up_s": 1.3}
    assert schedule_line(event) == ("schedule chosen by --tune from iteration 5: fusion size, priority on, predicted "
                                    "1.235 s/it; runner-up fusion none, priority on, 1.300 s/it")
    rounds = [RunResult("auto", [1.0, 1.2], 1.1, 1.2, 2, compute_s=0.8, **decision_fields(
                  {**event, "knobs": {"fusion": f}, "predicted_s": p, "runner_up_s": p + 0.1, "profile_compute_s": c}))
              for f, p, c in (("size", 1.0, 0.9), ("none", 1.2, 1.3))]
    given = RunResult("wfbp", [1.5], 1.5, 1.5, 1, **decision_fields({}))  # no schedule event: nothing was tuned
    report = summarize(SCENARIOS["B1"], {"auto": rounds, "wfbp": [given]})
    auto = report.strategies["auto"]
    assert auto.schedule == "fusion size; fusion none"
    assert auto.runner_up == "fusion none, priority on; fusion none, priority on"
    assert (auto.predicted_s, auto.runner_up_s, auto.profile_compute_s) == pytest.approx((1.1, 1.2, 1.1))
    assert report.strategies["wfbp"].predicted_s is None and report.strategies["wfbp"].runner_up_s is None
    assert ("auto: --tune chose fusion size; fusion none, predicted 1.100 s/it; runner-up fusion none, priority "
            "on; fusion none, priority on, 1.200 s/it (measured mean 1.100 s/it; compute profiled 1.100 s/it, "
            "measured 0.800).") in markdown(report)
    assert "wfbp: --tune" not in markdown(report) and report.strategies["wfbp"].schedule == ""
    alone = decision_fields({"knobs": {"fusion": "size"}, "predicted_s": 1.0})  # a decision without a runner-up
    assert (alone["runner_up"], alone["runner_up_s"], alone["profile_compute_s"]) == ("", None, None)
