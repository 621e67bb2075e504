"""When a running job looks at its schedule again (``--tune``, online): a pure policy over the windows it measures.

After the plan switch, worker 0 reports every ``--retune-window`` iterations
the window's mean iteration time (and what the pushes cost, for the
re-evaluation). The policy compares each window with the *expected* time of
the schedule in use: first the tuner's prediction; after an evaluation, the
prediction corrected by how far the simulator was off at that evaluation
(``measured / predicted`` of the schedule then in use), so that a simulator
that is, say, 30% slow everywhere does not look like a drift forever.

* A window off the expected time by more than ``drift`` (either way: a
  straggler, a congested link, another job on the network, or one that left)
  counts; one within it resets the count. After ``windows`` such windows in a
  row the coordinator re-evaluates with the new measurements.
* Oscillation: after an evaluation no other one for ``dwell`` windows, a dwell
  that doubles after each evaluation that kept the schedule; the tuner moves
  only to a schedule predicted ``margin`` (5%) faster than the one in use; at most
  ``max_switches`` switches in a job.

No grpc, no redis: the coordinator drives it with the reports it takes.
"""
from __future__ import annotations

import dataclasses

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RetuneSettings:
    drift: float = 0.25  # a window off the expected time by more than this fraction counts
    windows: int = 3  # drifted windows in a row before a re-evaluation
    dwell: int = 5  # windows without an evaluation after one (doubled after each that kept the schedule)
    max_switches: int = 4  # schedule switches in a job, at most
    margin: float = 0.05  # a switch only to a schedule predicted this much faster than the one in use

    def __post_init__(self) -> None:
        if not (self.drift > 0 and self.windows >= 1 and self.dwell >= 0 and self.max_switches >= 0
                and 0 <= self.margin < 1):
            raise ConfigError("retune", f"invalid re-tuning settings {self}")


@dataclasses.dataclass(frozen=True)
class RetuneState:
    """Where the policy stands: the expected window time and the counts of the guards."""

    expected_s: float  # the mean iteration time the schedule in use is expected to give
    drifted: int = 0  # windows in a row off ``expected_s`` by more than the drift
    dwell_left: int = 0  # windows still to pass before an evaluation may happen
    dwell: int = 0  # the next dwell's length
    switches: int = 0
    evaluations: int = 0
    drifted_s: tuple[float, ...] = ()  # the drifted windows' times (their mean is what the evaluation measured)

    @property
    def measured_s(self) -> float:
        """The mean of the drifted windows (0 before any)."""
        return sum(self.drifted_s) / len(self.drifted_s) if self.drifted_s else 0.0


def start(predicted_s: float, settings: RetuneSettings) -> RetuneState:
    """The state at the plan switch: the tuner's prediction expected, no dwell."""
    return RetuneState(expected_s=predicted_s, dwell=settings.dwell)


def observe(state: RetuneState, window_s: float, settings: RetuneSettings) -> tuple[RetuneState, bool]:
    """One window's mean iteration time: the new state, and whether to re-evaluate now."""
    if state.dwell_left > 0:
        return dataclasses.replace(state, dwell_left=state.dwell_left - 1), False
    if state.expected_s <= 0 or abs(window_s - state.expected_s) <= settings.drift * state.expected_s:
        return dataclasses.replace(state, drifted=0, drifted_s=()), False
    drifted = dataclasses.replace(state, drifted=state.drifted + 1, drifted_s=(*state.drifted_s, window_s))
    if drifted.drifted < settings.windows or state.switches >= settings.max_switches:
        return drifted, False
    return drifted, True


def evaluated(state: RetuneState, current_s: float, chosen_s: float, switched: bool) -> RetuneState:
    """After an evaluation: ``current_s`` is the schedule in use re-predicted under the new measurements,
    ``chosen_s`` the prediction of the schedule chosen (the same where it was kept). The expected time becomes the
    chosen one's prediction, corrected by the simulator's error on the schedule that ran."""
    correction = state.measured_s / current_s if current_s > 0 and state.measured_s > 0 else 1.0
    dwell = state.dwell if switched else state.dwell * 2
    return RetuneState(expected_s=chosen_s * correction, dwell_left=dwell, dwell=dwell,
                       switches=state.switches + int(switched), evaluations=state.evaluations + 1)


def worth_switching(current_s: float, chosen_s: float, settings: RetuneSettings) -> bool:
    """Whether a schedule predicted at ``chosen_s`` is clearly faster than the one in use (``current_s``)."""
    return chosen_s < current_s * (1 - settings.margin)
