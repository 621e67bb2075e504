"""The benchmark's results are typed; results.json is their JSON and reads back equal, an older file with
defaults for what it lacks, and a file that is not one is refused naming it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from imerge.bench.report import markdown
from imerge.core.bench_results import BenchReport, ScalingReport, StrategyResult, read_results
from imerge.core.errors import ConfigError
from imerge.core.strategies import SCENARIOS


def strategy(name: str, seconds: float) -> StrategyResult:
    return StrategyResult(name, [seconds, seconds * 1.1], seconds, seconds * 1.1, 2, compute_s=0.01,
                          link_utilization_per_shard={"ps0": 0.5}, utilization_series=[(0.0, {"ps0": 10})],
                          tcp_retransmissions=7, tcp_retransmissions_per_host={"ps0": 5, "worker1": 2},
                          rounds=2, bound_s=seconds / 2, ratio_to_bound=2.0, ratio_to_ddp=1.0)


def test_a_report_reads_back_equal_from_its_results_json(tmp_path):
    one = BenchReport(SCENARIOS["tiny"], 0.01, {"ddp": strategy("ddp", 0.1), "imerge": strategy("imerge", 0.2)},
                      "imerge bench tiny", "tiny")
    scaling = ScalingReport(SCENARIOS["B4"], {1: one, 2: dataclasses.replace(one, name="B4 W=2")}, "", "B4")
    for report in (one, scaling):
        path = tmp_path / "results.json"
        path.write_text(json.dumps(report.to_json()))
        assert read_results(path) == report


def test_an_older_results_json_reads_with_defaults_for_what_it_lacks(tmp_path):
    path = tmp_path / "results.json"  # a file of a release before push_p99_ms and the retransmission count
    path.write_text(json.dumps({"scenario": dataclasses.asdict(SCENARIOS["tiny"]), "strategies": {
        "imerge": {"strategy": "imerge", "iteration_s": [0.1], "median_iteration_s": 0.1, "p90_iteration_s": 0.1,
                   "a_field_of_the_future": 1}}}))
    report = read_results(path)
    assert isinstance(report, BenchReport) and report.strategies["imerge"].push_p99_ms is None
    assert report.strategies["imerge"].tcp_retransmissions == 0 and report.scenario == SCENARIOS["tiny"]
    assert report.strategies["imerge"].tcp_retransmissions_per_host == {}


def test_the_table_says_who_retransmitted():
    report = BenchReport(SCENARIOS["tiny"], 0.01, {"ddp": dataclasses.replace(
        strategy("ddp", 0.1), tcp_retransmissions=0, tcp_retransmissions_per_host={}), "imerge": strategy("imerge", 0.2)},
        "imerge bench tiny", "tiny")
    table = markdown(report)
    assert "| 7 |" in table and "imerge: TCP segments retransmitted by ps0 5, worker1 2." in table
    assert "ddp: TCP segments" not in table


@pytest.mark.parametrize("text", ["not json", '{"strategies": {}}', '[1, 2]', '{"scenario": {}, "strategies": 3}'])
def test_a_file_that_is_not_a_results_json_is_refused_naming_it(tmp_path, text):
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="other.json"):
        read_results(path)
