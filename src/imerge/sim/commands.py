"""What ``imerge simulate TARGET`` does with its options; writes results.json and results.md to ``--out``."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from imerge.core.bench_results import JsonReport
from imerge.core.errors import ConfigError
from imerge.core.schedule_config import ScheduleConfig
from imerge.core.strategies import SCENARIOS

from .results import CalibrationReport, ExplainReport
from .runner import TARGETS, SimConfig, markdown, simulate
from .tuning import chosen_schedule, explain_markdown, tune


def run_target(target: str, config: SimConfig, base: ScheduleConfig, say: Callable[[str], None],
               pinned: frozenset[str] = frozenset()) -> str:
    """Run ``target`` (one of TARGETS); return its markdown report (also written to the output folder).
    ``pinned``: the scheduling options the user's flags gave (``--explain`` varies none of them)."""
    if target not in TARGETS:
        raise ConfigError("target", f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    if target not in ("job", "calibrate"):  # the targets that draw figures: say so before simulating
        from .plots import pyplot

        pyplot(f"imerge simulate {target}")
    out = Path(config.out or f"runs/simulate-{target}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    report: JsonReport
    if config.explain and target != "job":
        raise ConfigError("explain", f"explains the schedule of a job (the target job), not {target}")
    if target == "job" and config.explain:
        report, text = _explain(config, base, pinned, say)
    elif target == "job":
        job = simulate(config.load_profile(), config.cluster(), config.constants(), config.chosen(), config.iters,
                       base, budget_s=config.budget_s, say=say)
        report, text = job, markdown(job)
    elif target == "calibrate":
        calibration, text = _calibrate(config, say)
        (out / "calibration.json").write_text(calibration.constants.to_json())
        say(f"calibration written to {out / 'calibration.json'}")
        report = calibration
    elif target == "projections":
        from .projections import projections_markdown, run_projections

        projections = run_projections(config, base, out, say)
        report, text = projections, projections_markdown(projections)
    else:
        from .plots import plot_comparison
        from .testbed import comparison_markdown, simulate_scenario, testbed_constants

        names = config.chosen(SCENARIOS[target].strategies)
        comparison = simulate_scenario(target, names, config.constants(testbed_constants()), config.iters, base,
                                       config.measured, (config.workers,) if config.workers != 8 else ())
        report, text = comparison, comparison_markdown(comparison)
        if plot_comparison(comparison, out / "comparison.png") is None:
            say(f"no figure: comparison.png plots the simulation against a measurement; give --measured with the "
                f"results.json of imerge bench {target} to draw it")
    (out / "results.json").write_text(json.dumps(report.to_json(), indent=1, default=_plain))
    (out / "results.md").write_text(text)
    say(f"results in {out}/ (results.json, results.md)")
    return text


def _explain(config: SimConfig, base: ScheduleConfig, pinned: frozenset[str], say: Callable[[str], None]
             ) -> tuple[ExplainReport, str]:
    """The tuner's decision for the job, and the chosen schedule ('auto') beside the strategies."""
    profile, cluster, constants = config.load_profile(), config.cluster(), config.constants()
    tuning = tune(profile, cluster, constants, base, set(pinned), progress=say)
    job = simulate(profile, cluster, constants, config.chosen(), config.iters, base,
                   {"auto": chosen_schedule(tuning, base)}, config.budget_s, say)
    return ExplainReport(tuning, job), explain_markdown(tuning) + "\n" + markdown(job)


def _calibrate(config: SimConfig, say: Callable[[str], None]) -> tuple[CalibrationReport, str]:
    from .calibrate import MULTIPLES, cases_of, fit, fit_markdown, fit_table

    paths = [p.strip() for p in config.runs.split(",") if p.strip()]
    if not paths:
        raise ConfigError("runs", "calibrate needs --runs: the results.json of one or more imerge bench runs")
    missing = [p for p in paths if not Path(p.partition("#")[0]).is_file()]
    if missing:
        raise ConfigError("runs", f"no such file: {', '.join(missing)}")
    cases = cases_of(paths, set(config.chosen()) if config.strategies else None)
    if not cases:
        raise ConfigError("runs", "the runs hold none of the chosen strategies")
    from .calibrate import FINE, START

    start = config.constants() if config.calibration else START  # a calibration given: refine it, finer
    constants, fit_loss = fit(cases, progress=say, start=start, multiples=FINE if config.calibration else MULTIPLES)
    rows = fit_table(cases, constants)
    return CalibrationReport(constants, fit_loss, rows, paths), fit_markdown(constants, fit_loss, rows)


def _plain(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
