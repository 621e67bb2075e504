"""Online re-tuning (--tune with --retune-window): the policy that says when to decide again, the windows worker 0
measures, the switch every worker takes at the same iteration, and a job that computes bit for bit the same."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import pytest
import torch

from imerge.control.messages import PlanPublished, Profile, Window
from imerge.control.store import Store
from imerge.core.errors import ConfigError, IMergeError, StoreError
from imerge.core.planning import COST_PLAN, FIRST_PLAN, Layout, ParamInfo, PlanOptions, make_plan
from imerge.core.retune import RetuneSettings, evaluated, observe, start, worth_switching
from imerge.core.schedule_config import ScheduleConfig
from imerge.worker.retuning import Retuning, WindowMeter

from test_job_tuning import _run
from test_equivalence import WORKERS, batches

SETTINGS = RetuneSettings()


# -- the policy --------------------------------------------------------------------------------------------
def _feed(state, times):
    decisions = []
    for seconds in times:
        state, evaluate = observe(state, seconds, SETTINGS)
        decisions.append(evaluate)
    return state, decisions


def test_three_drifted_windows_in_a_row_ask_for_a_decision_and_one_within_the_margin_resets_the_count():
    state = start(1.0, SETTINGS)
    state, decisions = _feed(state, [1.2, 0.8, 1.3, 1.3, 1.0, 1.3, 0.7])  # 1.3 and 0.7 drift (beyond 25%)
    assert decisions == [False] * 7 and state.drifted == 2  # the 1.0 reset the count
    state, decisions = _feed(state, [1.4])
    assert decisions == [True] and state.measured_s == pytest.approx((1.3 + 0.7 + 1.4) / 3)


def test_after_an_evaluation_the_expected_time_is_corrected_and_a_dwell_doubles_while_the_schedule_is_kept():
    state, _ = _feed(start(1.0, SETTINGS), [2.0, 2.0, 2.0])
    kept = evaluated(state, current_s=1.6, chosen_s=1.6, switched=False)  # the simulator is 20% slow
    assert kept.expected_s == pytest.approx(2.0) and kept.dwell_left == 2 * SETTINGS.dwell and kept.switches == 0
    quiet, decisions = _feed(kept, [3.0] * (2 * SETTINGS.dwell))
    assert not any(decisions) and quiet.drifted == 0  # nothing counts during the dwell
    switched = evaluated(state, current_s=1.6, chosen_s=0.8, switched=True)
    assert switched.expected_s == pytest.approx(1.0)  # the new schedule's prediction, corrected the same way
    assert switched.dwell_left == SETTINGS.dwell and switched.switches == 1


def test_no_more_than_the_most_switches_and_only_a_clearly_faster_schedule():
    state = dataclasses.replace(start(1.0, SETTINGS), switches=SETTINGS.max_switches)
    _, decisions = _feed(state, [5.0] * 10)
    assert not any(decisions)
    assert worth_switching(1.0, 0.94, SETTINGS) and not worth_switching(1.0, 0.96, SETTINGS)
    with pytest.raises(ConfigError):
        RetuneSettings(windows=0)


# -- the window and the profile it remeasures ----------------------------------------------------------------
def test_a_window_travels_whole_and_remeasures_the_profile():
    window = Window(generation=0, plan=2, iteration=40, iteration_s=0.5, forward_wait_s=0.1, alpha_s=1e-3,
                    beta_s_per_byte=2e-9)
    assert Window.decode(window.encode()) == window and window.compute_s == pytest.approx(0.4)
    with pytest.raises(StoreError, match="Window"):
        Window.decode('{"generation": 0, "plan": 2, "iteration": 1, "iteration_s": -1, "forward_wait_s": 0}')
    profile = Profile(ready_s=[0.05, 0.1], unit_bytes=[400, 800], alpha_s=1e-4, beta_s_per_byte=1e-8,
                      forward_s=[0.05, 0.05], iteration_s=0.3)
    assert Profile.decode(profile.encode()) == profile
    older = json.loads(profile.encode())
    del older["iteration_s"]  # a profile of a worker before the iteration time was measured
    assert Profile.decode(json.dumps(older)).iteration_s == 0.0
    with pytest.raises(StoreError, match="iteration_s must be finite"):
        Profile.decode(json.dumps({**older, "iteration_s": float("nan")}))
    remeasured = profile.remeasured(window)  # compute 0.2 s profiled, 0.4 measured: twice as slow
    assert remeasured.ready_s == pytest.approx([0.1, 0.2]) and remeasured.forward_s == pytest.approx([0.1, 0.1])
    assert (remeasured.alpha_s, remeasured.beta_s_per_byte) == (1e-3, 2e-9)
    assert remeasured.iteration_s == 0.0  # measured on plan v1, not on the schedule of the window
    unfitted = profile.remeasured(dataclasses.replace(window, alpha_s=0.0, beta_s_per_byte=0.0))
    assert (unfitted.alpha_s, unfitted.beta_s_per_byte) == (1e-4, 1e-8)  # too few pushes: the profile's


def test_the_meter_times_each_iteration_after_the_first_and_fits_the_pushes():
    meter = WindowMeter()
    for waited in (0.0, 0.01, 0.01):
        meter.iteration(waited)
        time.sleep(0.02)
    for nbytes in (1000, 2000, 3000, 4000):
        meter.push(nbytes, 1e-3 + nbytes * 1e-6)
    window = meter.window(1, 3, 20)
    assert window is not None and (window.generation, window.plan, window.iteration) == (1, 3, 20)
    assert window.iteration_s >= 0.02 and window.forward_wait_s == pytest.approx(0.01)
    assert window.alpha_s == pytest.approx(1e-3) and window.beta_s_per_byte == pytest.approx(1e-6)
    assert meter.window(1, 3, 40) is None  # nothing timed since


# -- the switch: published only where no worker can miss it --------------------------------------------------
def _plan(version: int, switch_at: int = 0):
    layout = Layout((ParamInfo("a", (64,), "a"), ParamInfo("b", (64,), "b")))
    return dataclasses.replace(make_plan(layout, 2, ["s0:1"], version, PlanOptions()), switch_at=switch_at)


def test_a_re_tuned_plan_is_published_only_before_every_worker_polls_the_boundary_ahead_of_its_switch(redis_url):
    store = Store(redis_url, "retune-publish")
    store.clear_job()
    try:
        store.publish_plan(FIRST_PLAN, PlanPublished(_plan(FIRST_PLAN)))
        store.publish_plan(COST_PLAN, PlanPublished(_plan(COST_PLAN)))
        assert store.poll_plans(0, 20) == COST_PLAN and store.poll_plans(1, 40) == COST_PLAN
        # switch at 60: the boundary before it, 40, was polled by worker 1 already, which could miss it
        assert store.publish_switch(PlanPublished(_plan(3, switch_at=60)), 2, 40) == 40
        assert store.read_plan(3) is None and store.latest_version() == COST_PLAN
        assert store.publish_switch(PlanPublished(_plan(3, switch_at=80)), 2, 60) == -1
        assert store.poll_plans(0, 40) == 3 and store.latest_plan().result().switch_at == 80
    finally:
        store.clear_job()
        store.close()


def test_a_worker_switches_after_the_iteration_the_plan_names_and_never_silently_late(redis_url):
    store = Store(redis_url, "retune-worker")
    store.clear_job()
    try:
        store.publish_plan(COST_PLAN, PlanPublished(_plan(COST_PLAN)))
        retuning = Retuning(store, rank=1, window=10, known=COST_PLAN)
        assert [retuning.after_backward(i, 0, COST_PLAN, 0.0) for i in range(1, 11)] == [None] * 10
        assert store.publish_switch(PlanPublished(_plan(3, switch_at=30)), 2, 20) == -1
        switched = [retuning.after_backward(i, 0, COST_PLAN, 0.0) for i in range(11, 31)]
        assert [p.version if p else None for p in switched] == [None] * 19 + [3]
        late = Retuning(store, rank=0, window=10, known=COST_PLAN)
        with pytest.raises(IMergeError, match="switches at iteration 30, read only at 40"):
            late.after_backward(40, 0, COST_PLAN, 0.0)
        assert store.read_plan(3) is not None
        assert store.publish_switch(PlanPublished(_plan(4, switch_at=50)), 2, 40) == 40  # worker 0 polled 40
    finally:
        store.clear_job()
        store.close()


def test_a_bad_retune_window_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match="--retune-window: must be >= 0"):
        ScheduleConfig(retune_window=-1)
    assert ScheduleConfig(retune_window=5, tune="none").plan_options().retune_window == 0  # nothing to re-tune


# -- a real job ------------------------------------------------------------------------------------------------
def test_a_job_re_tunes_online_and_computes_bit_for_bit_what_the_given_schedule_does(cluster, caplog):
    """The coordinator is told of a 1 Mbit/s link: the windows run far faster than predicted, so after three
    windows it decides again on what they measured. Meanwhile a switch to another fusion and push order is published
    (as the re-tuning would) once plan v2 runs: every worker takes it after the same iteration, and the parameters
    equal, bit for bit, those of the schedule as given (--tune none)."""
    caplog.set_level(logging.INFO)
    data = batches()  # 20 iterations: profile 3, plan v2, windows of 2
    tuned = cluster(WORKERS, 1, coordinator_options=dict(link_gbit=0.001))
    published = []

    def switch_when_v2_runs():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and tuned.coordinator.retuner is None:
            time.sleep(0.01)
        retuner = tuned.coordinator.retuner
        if retuner is not None:
            knobs = dict(retuner.plan.knobs)
            forced = {"fusion": "size" if knobs.get("fusion") != "size" else "none",
                      "priority": "off" if knobs.get("priority") == "on" else "on"}
            published.append(retuner.publish({**knobs, **forced}, {"predicted_s": 0.5}, after=4))

    switcher = threading.Thread(target=switch_when_v2_runs, daemon=True)
    switcher.start()
    results = _run(tuned, data, profile_iters=3, retune_window=2)
    switcher.join(5)
    assert published and published[0] is not None, "no switch was published"
    plan = published[0]
    assert plan.version >= 3 and plan.switch_at % 2 == 0 and plan.switch_at >= 8
    took = [r.getMessage() for r in caplog.records if "re-tuned online" in r.getMessage()]
    assert len([m for m in took if f"plan v{plan.version} " in m]) == WORKERS, took
    assert all(f"from iteration {plan.switch_at + 1}" in m for m in took if f"plan v{plan.version} " in m), took
    evaluations = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-tuning after")]
    assert evaluations, "the drift from the 1 Mbit/s prediction was never evaluated"

    given = cluster(WORKERS, 1)
    expected = _run(given, data, profile_iters=3, tune="none")
    for worker, params in enumerate(results):
        for name, value in expected[0].items():
            assert torch.equal(params[name], value), f"worker {worker}, {name} differs after the re-tuned switch"


def test_a_worker_waiting_at_the_plan_switch_leaves_as_soon_as_the_job_recovers_without_the_plan(redis_url):
    """Worker 0 failed before it submitted its profile: the others do not wait out their timeout for plan v2."""
    from imerge.control.messages import GenerationEvent
    from imerge.core.errors import GenerationChanged, JobFailed, WaitTimeout

    store = Store(redis_url, "retune-wait")
    store.clear_job()
    try:
        store.start_generation(GenerationEvent(0, round=0))
        with pytest.raises(WaitTimeout, match="the cost plan"):
            store.wait_switch_plan(COST_PLAN, 0, 0.3, "the cost plan")
        threading.Timer(0.5, lambda: store.start_generation(GenerationEvent(1, round=0, reason="worker 0"))).start()
        started = time.monotonic()
        with pytest.raises(GenerationChanged, match="generation 1"):
            store.wait_switch_plan(COST_PLAN, 0, 60, "the cost plan")
        assert time.monotonic() - started < 5
        store.start_generation(GenerationEvent(2, error="no checkpoint"))
        with pytest.raises(JobFailed, match="no checkpoint"):
            store.wait_switch_plan(COST_PLAN, 1, 60, "the cost plan")
        store.publish_plan(COST_PLAN, PlanPublished(_plan(COST_PLAN)))
        assert store.wait_switch_plan(COST_PLAN, 1, 1, "the cost plan").result().version == COST_PLAN
    finally:
        store.clear_job()
        store.close()


def test_a_re_tuned_plan_keeps_the_groups_in_use_where_fusion_is_not_tuned(redis_url):
    """--fusion cost pinned (or T > 1, where fusion is never tuned): a re-tuned plan changes the push order or the
    slots only; regrouping on the window's remeasured profile would change which parameters travel, and at T > 1
    what the job computes."""
    from imerge.coordinator.retuning import RetuneContext, Retuner
    from imerge.coordinator.service import CoordinatorConfig

    layout = Layout(tuple(ParamInfo(f"m{u}", (256,), f"m{u}") for u in range(4)))
    options = PlanOptions(fusion="cost", period=2, tune="priority", retune_window=10)
    first = make_plan(layout, 2, ["s0:1"], FIRST_PLAN, options)
    in_use = dataclasses.replace(first, version=COST_PLAN, knobs=(("priority", "on"),), predicted_s=1.0)
    profile = Profile(ready_s=[0.01, 0.02, 0.03, 0.04], unit_bytes=[1024] * 4, alpha_s=1.0, beta_s_per_byte=1e-9)
    assert len(in_use.groups) == 4  # one group per module; fusion cost on this profile (alpha 1 s) would merge them
    store = Store(redis_url, "retune-groups")
    store.clear_job()
    try:
        config = CoordinatorConfig(job="retune-groups", redis_url=redis_url, num_workers=2)
        retuner = Retuner(config, store, RetuneContext(layout, options, first, ScheduleConfig(), profile), in_use)
        plan = retuner.publish({"priority": "off"}, {"predicted_s": 0.9}, after=10, profile=profile)
        assert plan is not None and plan.groups == in_use.groups and dict(plan.knobs) == {"priority": "off"}
    finally:
        store.clear_job()
        store.close()


def test_an_evaluation_runs_off_the_report_loop_and_windows_meanwhile_are_left_out(redis_url):
    """The coordinator hands a window to the re-tuner and goes back to its reports and heartbeats at once: the
    simulations run on a thread of their own; a window that comes meanwhile is left out, not queued."""
    from imerge.coordinator.retuning import RetuneContext, Retuner
    from imerge.coordinator.service import CoordinatorConfig

    layout = Layout(tuple(ParamInfo(f"m{u}", (256,), f"m{u}") for u in range(4)))
    options = PlanOptions(fusion="none", tune="priority", retune_window=10)
    first = make_plan(layout, 2, ["s0:1"], FIRST_PLAN, options)
    in_use = dataclasses.replace(first, version=COST_PLAN, knobs=(("priority", "on"),), predicted_s=1.0)
    profile = Profile(ready_s=[0.01, 0.02, 0.03, 0.04], unit_bytes=[1024] * 4, alpha_s=1e-3, beta_s_per_byte=1e-9)
    store = Store(redis_url, "retune-thread")
    store.clear_job()
    try:
        config = CoordinatorConfig(job="retune-thread", redis_url=redis_url, num_workers=2)
        retuner = Retuner(config, store, RetuneContext(layout, options, first, ScheduleConfig(), profile), in_use)
        retuner.state = dataclasses.replace(retuner.state, drifted=SETTINGS.windows - 1)  # the next drift decides
        window = Window(generation=0, plan=COST_PLAN, iteration=30, iteration_s=3.0, forward_wait_s=0.0, alpha_s=1e-3,
                        beta_s_per_byte=1e-9)
        published: list = []
        with retuner._lock:  # as if a long evaluation held it: submit must not wait for it
            started = time.monotonic()
            assert retuner.submit(window, published.append)
            assert not retuner.submit(dataclasses.replace(window, iteration=40), published.append)
            assert time.monotonic() - started < 0.5 and retuner.state.evaluations == 0
        assert retuner.wait_idle(60)
        assert retuner.state.evaluations == 1  # the first window was decided on, the second left out
        assert published == ([retuner.plan] if retuner.plan.version > COST_PLAN else [])
    finally:
        store.clear_job()
        store.close()


def test_reports_that_keep_coming_do_not_starve_the_checks_of_the_members_and_the_jobs_keys(redis_url):
    """Worker 0's windows come every fraction of a second in a fast job. Between them the coordinator must still
    check the members and the job's keys: here the keys vanish (Redis restarted empty) while windows keep
    coming, and the coordinator stops within seconds, naming the cause."""
    from imerge.control.messages import GenerationEvent
    from imerge.control.store import CoordinatorStore, WorkerStore
    from imerge.coordinator.recovery import RecoveryImpossible
    from imerge.coordinator.service import Coordinator, CoordinatorConfig

    job = "retune-flood"
    store, worker = CoordinatorStore(redis_url, job), WorkerStore(redis_url, job)
    store.clear_job()
    store.start_generation(GenerationEvent(0, round=0))
    coordinator = Coordinator(CoordinatorConfig(job=job, redis_url=redis_url, num_workers=1, num_shards=1), store)
    stop, raised = threading.Event(), []

    def flood() -> None:
        while not stop.is_set():
            worker.submit_window(Window(0, COST_PLAN, 20, 0.1, 0.0))
            time.sleep(0.05)

    def watch() -> None:
        try:
            coordinator.watch()
        except RecoveryImpossible as exc:
            raised.append(exc)

    threads = [threading.Thread(target=flood, daemon=True), threading.Thread(target=watch, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        store.clear_job()
        threads[1].join(5)
        assert raised and "Redis lost the job's state" in str(raised[0]), "the windows starved the checks"
    finally:
        coordinator.stop()
        stop.set()
        threads[0].join(5)  # before its connection closes under a call
        store.clear_job()
        worker.close()
        store.close()
