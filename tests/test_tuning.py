"""The tuner (imerge.sim.tuning): it finds the fastest of its candidates, never touches what the user pinned or the
interleave period, and `imerge simulate --explain` says what it chose and why."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from imerge.core.schedule_config import ScheduleConfig
from imerge.sim.cluster import Cluster, Constants
from imerge.sim.profiles import synthetic
from imerge.sim.tuning import KNOBS, MARGIN, apply, chosen_schedule, simulate_schedule, tune

PROFILE = synthetic("resnet18-like", 32, 25.0)
CLUSTER = Cluster(4, 2, 10.0, 10.0, shard_cores=0, worker_cores=0)
ALL_BUT = {knob: {key for value in values.values() for key in value} for knob, values in KNOBS.items()}


def pinned_except(*free: str) -> set[str]:
    """The option names that pin every knob but ``free``."""
    return set().union(*(fields for knob, fields in ALL_BUT.items() if knob not in free))


def test_the_tuner_finds_the_fastest_of_its_candidates():
    """Two free knobs: the coordinate descent's choice is within its margin of the best of all their values."""
    base = ScheduleConfig()
    report = tune(PROFILE, CLUSTER, Constants(), base, pinned_except("fusion", "priority"))
    brute = min(simulate_schedule(PROFILE, CLUSTER, Constants(), apply(base, dict(fusion=f, priority=p)))
                .mean_iteration_s for f, p in itertools.product(KNOBS["fusion"], KNOBS["priority"]))
    assert report.chosen.mean_iteration_s <= brute * (1 + MARGIN) + 1e-12
    assert set(report.chosen.knobs) == {"fusion", "priority"}
    assert report.pinned == [k for k in KNOBS if k not in ("fusion", "priority", "compression")]
    assert report.runner_up is not None and report.runner_up.knobs != report.chosen.knobs
    assert [t.mean_iteration_s for t in report.trials] == sorted(t.mean_iteration_s for t in report.trials)
    assert report.decided_in_cpu_s > 0


def test_the_tuner_keeps_what_the_user_pinned_and_the_period():
    base = ScheduleConfig(fusion="size", slots="ack", slot_scope="group", slot_width=1, interleave_period=2)
    report = tune(PROFILE, CLUSTER, Constants(), base, {"fusion", "slot_scope", "partition_mib", "placement"})
    chosen = chosen_schedule(report, base)
    assert (chosen.fusion, chosen.slot_scope, chosen.partition_mib, chosen.placement) == ("size", "group", 0.0, "lpt")
    assert chosen.interleave_period == 2 and chosen.compression == "none"  # compression only where allowed
    assert set(report.chosen.knobs) == {"priority"}
    assert sorted(report.pinned) == ["fusion", "partition", "placement", "slots"]


def test_a_tie_keeps_the_given_schedule():
    """With nothing to gain (a model whose compute hides all communication) the given schedule stays."""
    slow = PROFILE.scaled(5.0)
    base = ScheduleConfig(fusion="none", priority=False)
    report = tune(slow, CLUSTER, Constants(), base, pinned_except("fusion", "priority"))
    assert report.chosen.knobs == {"fusion": "none", "priority": "off"}


def test_a_candidate_whose_simulation_would_pass_the_budget_is_not_tried_and_the_report_says_so():
    """Slot flags at W = 8 over a port queue: each lane position is a worker class of its own (group scope: 8
    classes against one without flags). A budget that the first simulation spends keeps every further one out,
    each named; an ample one tries them all, flags included."""
    queued = dataclasses.replace(CLUSTER, workers=8, queue_kb=32.0)
    base = ScheduleConfig()
    ample = tune(PROFILE, queued, Constants(), base, pinned_except("slots"), budget_cpu_s=1e6)
    assert {t.knobs["slots"] for t in ample.trials} == set(KNOBS["slots"]) and not ample.skipped
    tight = tune(PROFILE, queued, Constants(), base, pinned_except("slots"), budget_cpu_s=0.0)
    assert [t.knobs for t in tight.trials] == [{"slots": "off"}]  # the given schedule is always simulated
    assert len(tight.skipped) == len(KNOBS["slots"]) - 1
    assert all("past its budget of 0 CPU s" in reason for reason in tight.skipped)
    assert any("slots group: its simulation (8 worker classes" in reason for reason in tight.skipped)


def test_partitions_that_cut_the_same_blocks_are_simulated_once(monkeypatch):
    """From 8 shards on, lpt cuts a shard's even share of the model: on 16 shards every partition candidate of a
    ResNet-18-like model yields the same blocks, so one simulation answers for the three."""
    import imerge.sim.tuning as tuning

    calls = []
    monkeypatch.setattr(tuning, "simulate_schedule", lambda *args, **kw: calls.append(args[3]) or
                        simulate_schedule(*args, **kw))
    wide = dataclasses.replace(CLUSTER, shards=16)
    report = tune(PROFILE, wide, Constants(), ScheduleConfig(), pinned_except("partition"))
    assert {t.knobs["partition"] for t in report.trials} == set(KNOBS["partition"])
    assert len({t.mean_iteration_s for t in report.trials}) == 1 and len(calls) == 1
    narrow = tune(PROFILE, CLUSTER, Constants(), ScheduleConfig(), pinned_except("partition"))  # 2 shards: they differ
    assert len({t.mean_iteration_s for t in narrow.trials}) == 4 and len(calls) == 5  # auto: 8 MiB at 10 Gbit/s
    slow = tune(PROFILE, dataclasses.replace(CLUSTER, worker_gbit=1.0), Constants(), ScheduleConfig(),
                pinned_except("partition"))  # at 1 Gbit/s auto cuts 1 MiB blocks: simulated once for both
    by_knob = {t.knobs["partition"]: t.mean_iteration_s for t in slow.trials}
    assert by_knob["auto"] == by_knob["1 MiB"] and len(set(by_knob.values())) == 3 and len(calls) == 8


def test_explain_prints_the_choice_the_runner_up_and_auto_beside_the_strategies(tmp_path, capsys):
    from imerge.cli import main

    assert main(["simulate", "--model", "resnet18-like", "--workers", "4", "--shards", "2", "--iters", "8",
                 "--strategies", "wfbp,size", "--explain", "--fusion", "cost", "--slots", "off",
                 "--partition-mib", "1", "--placement", "lpt", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "chosen priority o" in out and "runner-up priority o" in out and "CPU s over" in out
    assert "pinned by flags: fusion, slots, partition, placement" in out
    assert "| auto |" in out and "| wfbp |" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tuning"]["chosen"]["knobs"] == {"priority": "on"} or saved["tuning"]["chosen"]["knobs"] == \
        {"priority": "off"}
    assert set(saved["job"]["strategies"]) == {"wfbp", "size", "auto"}
    assert main(["simulate", "projections", "--explain"]) == 2
    assert "explain" in capsys.readouterr().err


def test_every_knob_value_is_a_valid_schedule():
    for knob, values in KNOBS.items():
        for value, fields in values.items():
            schedule = dataclasses.replace(ScheduleConfig(), **fields)
            assert all(getattr(schedule, key) == wanted for key, wanted in fields.items()), (knob, value)


@pytest.mark.parametrize("knob", ["fusion", "slots"])
def test_a_knob_is_pinned_by_any_of_its_options(knob):
    from imerge.sim.tuning import free_knobs

    for field in ALL_BUT[knob]:
        free, pinned = free_knobs({field}, compression_auto=False)
        assert knob in pinned and knob not in free


def test_flags_are_tried_only_against_a_port_queue_that_overflows():
    """Without a port queue (--queue-kb) the simulator has no incast for flags to avoid: they only serialize the
    pushes, so they are not simulated (each such candidate costs a simulated worker per lane position)."""
    deep = tune(PROFILE, CLUSTER, Constants(), ScheduleConfig(), pinned_except("slots"))
    assert len(deep.trials) == 1 and deep.chosen.knobs == {}
    assert any("no shard port queue" in reason for reason in deep.skipped)
    shallow = tune(PROFILE, dataclasses.replace(CLUSTER, queue_kb=16.0), Constants(), ScheduleConfig(),
                   pinned_except("slots"))
    assert {t.knobs["slots"] for t in shallow.trials} == set(KNOBS["slots"]) and not shallow.skipped
