"""--tune's decisions on the coordinator: the first one at the plan switch, and online re-tuning after it.

With ``--retune-window R`` (default 20; 0: decide once) worker 0 reports
every R iterations after the plan switch the window's mean iteration time,
forward wait and push cost (:class:`~imerge.control.messages.Window`). The
pure policy (:mod:`imerge.core.retune`) says when the job has drifted from
what its schedule was expected to give; then the tuner runs again on the
first profile remeasured by the window (each unit's compute scaled to the
window's, the push cost the window fitted) and, where the link rate was given
but the pushes measured faster than it, on the measured rate. A schedule
predicted clearly faster than the one in use becomes the next plan (v3, v4,
...), which every worker takes at the same iteration: ``switch_at``, a window
boundary at least two windows past the report, that no worker has reached
when the plan is published (the store's publish_switch checks it against each
worker's last poll, atomically). An evaluation runs on a thread of its own
(:meth:`Retuner.submit`): the coordinator keeps taking reports and checking
heartbeats while it simulates, and a window that comes meanwhile is left out.
A restarted coordinator does not re-tune.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from imerge.control.messages import PlanPublished, Profile, Window
from imerge.control.store import CoordinatorStore
from imerge.core.errors import IMergeError
from imerge.core.knobs import apply, describe
from imerge.core.planning import Layout, Plan, PlanOptions
from imerge.core.retune import RetuneSettings, evaluated, observe, start, worth_switching
from imerge.core.schedule_config import ScheduleConfig
from imerge.sim.cluster import GBIT, Constants
from imerge.sim.jobtune import JobDecision, decide, decided_plan, plan_knobs

log = logging.getLogger(__name__)
PUBLISH_TRIES = 8  # switch iterations tried, each past the furthest a worker had polled


class TuneConfig(Protocol):
    """What the coordinator's config gives the tuner (its ``--link-gbit``, ``--queue-kb``, ``--calibration``)."""

    @property
    def num_workers(self) -> int: ...
    @property
    def link_gbit(self) -> float: ...
    @property
    def queue_kb(self) -> float: ...
    @property
    def calibration(self) -> str: ...


def decide_logged(config: TuneConfig, profile: Profile, first: Plan, options: PlanOptions, base: ScheduleConfig,
                  *, link_gbit: float, what: str = "schedule chosen by --tune") -> JobDecision | None:
    """--tune's decision, logged with its prediction and the runner-up's; None (the schedule in use kept) where
    the simulation cannot run on this profile."""
    try:
        calibration = Constants.read(config.calibration) if config.calibration else None
        decision = decide(profile, first, options, base, link_gbit=link_gbit, queue_kb=config.queue_kb,
                          calibration=calibration)
    except (IMergeError, ValueError, ArithmeticError) as exc:
        log.error("--tune could not simulate the candidates (%s); the job keeps the schedule in use", exc)
        return None
    report = decision.report
    runner = report.runner_up
    log.info("%s: %s, predicted %.4f s/it; runner-up %s, %s; tuned %s on a cluster of %d workers, %d shards, "
             "links %.3g Gbit/s; decided in %.1f CPU s over %d candidates", what, describe(decision.knobs),
             report.chosen.mean_iteration_s, describe(runner.knobs) if runner else "none",
             f"predicted {runner.mean_iteration_s:.4f} s/it" if runner else "-", ", ".join(options.tuned_knobs),
             report.workers, report.shards, report.link_gbit, report.decided_in_cpu_s, len(report.trials))
    for reason in report.skipped:
        log.info("--tune did not try %s", reason)
    return decision


@dataclasses.dataclass(frozen=True)
class RetuneContext:
    """What the first decision was made from: the job's layout and options, plan v1, worker 0's schedule as given
    and its profile."""

    layout: Layout
    options: PlanOptions
    first: Plan
    base: ScheduleConfig
    profile: Profile


class Retuner:
    """Takes worker 0's windows (the coordinator's report loop) and publishes the next plan where the policy and
    the tuner say so."""

    def __init__(self, config: TuneConfig, store: CoordinatorStore, context: RetuneContext, plan: Plan,
                 settings: RetuneSettings = RetuneSettings()):
        self.config, self.store, self.context, self.settings = config, store, context, settings
        self.plan = plan  # the newest plan this job runs or will switch to
        self.state = start(plan.predicted_s, settings)
        self._lock = threading.RLock()  # one plan version at a time (publish may be called from another thread)
        self._deciding: threading.Thread | None = None  # an evaluation in progress (submit's)

    def counts(self) -> tuple[int, int]:
        """Evaluations and switches so far (the metrics)."""
        return self.state.evaluations, self.state.switches

    def submit(self, window: Window, published: Callable[[Plan], None]) -> bool:
        """Take one window off the coordinator's report loop: the evaluation (many simulations where flags are
        candidates) runs on a thread of its own, so reports and heartbeats are watched meanwhile; ``published``
        is called with a plan it published. False: a window that came while an evaluation ran (measured on the
        plan being replaced, or by then outdated), left out."""
        if self._deciding is not None and self._deciding.is_alive():
            log.debug("window up to iteration %d left out: a re-tuning evaluation is running", window.iteration)
            return False

        def evaluate() -> None:
            try:
                plan = self.take(window)
            except IMergeError as exc:  # a store error publishing: the job keeps its plan, the next window retries
                log.error("re-tuning after the window up to iteration %d failed (%s); the job keeps plan v%d",
                          window.iteration, exc, self.plan.version)
                return
            if plan is not None:
                published(plan)

        self._deciding = threading.Thread(target=evaluate, name="imerge-retune", daemon=True)
        self._deciding.start()
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an evaluation in progress; True when none runs."""
        thread = self._deciding
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def take(self, window: Window) -> Plan | None:
        """One window, decided on the calling thread: the plan published for the workers to switch to, or None."""
        with self._lock:
            if window.plan != self.plan.version:  # measured on an older plan: a switch to the newest is ahead
                return None
            self.state, evaluate = observe(self.state, window.iteration_s, self.settings)
            return self._evaluate(window) if evaluate else None

    def _evaluate(self, window: Window) -> Plan | None:
        ctx, cfg, expected = self.context, self.config, self.state.expected_s
        current = dict(self.plan.knobs)
        profile = ctx.profile.remeasured(window)
        measured_gbit = 1 / (profile.beta_s_per_byte * GBIT) if profile.beta_s_per_byte > 0 else 0.0
        link = cfg.link_gbit if cfg.link_gbit and not measured_gbit > cfg.link_gbit else 0.0
        options = dataclasses.replace(ctx.options, fusion=current.get("fusion") or ctx.options.fusion)
        decision = decide_logged(cfg, profile, ctx.first, options, apply(ctx.base, current), link_gbit=link,
                                 what=f"re-tuning after {self.state.drifted} windows at {self.state.measured_s:.4f} "
                                      f"s/it (expected {expected:.4f}), best")
        if decision is None:
            self.state = evaluated(self.state, expected, expected, switched=False)
            return None
        report = decision.report
        current_s = next((t.mean_iteration_s for t in report.trials if t.knobs == current),
                         report.chosen.mean_iteration_s)
        chosen_s = report.chosen.mean_iteration_s
        plan = None
        if decision.knobs != current and worth_switching(current_s, chosen_s, self.settings):
            fields = {**decision.plan_fields(), "runner_up": plan_knobs(current), "runner_up_s": current_s}
            plan = self.publish(decision.knobs, fields, window.iteration, profile)
        self.state = evaluated(self.state, current_s, chosen_s if plan else current_s, switched=plan is not None)
        if plan is None:
            log.info("re-tuning keeps %s (predicted %.4f s/it under the new measurements; best %s, %.4f); next "
                     "evaluation in %d windows at the earliest", describe(current), current_s,
                     describe(decision.knobs), chosen_s, self.state.dwell_left + self.settings.windows)
        return plan

    def publish(self, knobs: dict[str, str], fields: dict[str, Any], after: int,
                profile: Profile | None = None) -> Plan | None:
        """Publish the next plan with ``knobs`` for every worker to take at a window boundary at least two windows
        past iteration ``after`` that none has reached; None where every try found a worker past it."""
        with self._lock:
            return self._publish(knobs, fields, after, profile)

    def _publish(self, knobs: dict[str, str], fields: dict[str, Any], after: int, profile: Profile | None
                 ) -> Plan | None:
        ctx, window = self.context, self.context.options.retune_window
        plan = decided_plan(ctx.layout, ctx.options, ctx.first, profile or ctx.profile, knobs,
                            {"knobs": plan_knobs(knobs), **fields}, self.plan.version + 1)
        if "fusion" not in knobs:  # not tuned (pinned, or T > 1): the groups in use stay, whatever a new profile says
            plan = dataclasses.replace(plan, groups=self.plan.groups)
        switch_at = (after // window + 2) * window
        for _ in range(PUBLISH_TRIES):
            plan = dataclasses.replace(plan, switch_at=switch_at)
            furthest = self.store.publish_switch(PlanPublished(plan), self.config.num_workers, switch_at - window)
            if furthest < 0:
                log.info("published plan v%d (%s, predicted %.4f s/it, %d groups): every worker switches after "
                         "iteration %d", plan.version, describe(knobs), plan.predicted_s, len(plan.groups),
                         switch_at)
                self.plan = plan
                return plan
            switch_at = (furthest // window + 2) * window
        log.warning("re-tuning could not publish plan v%d: the workers kept passing the switch iteration",
                    plan.version)
        return None
