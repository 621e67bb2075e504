"""A block's rounds on a shard, as one state machine: events in, actions out. Pure, without I/O.

The shard (asyncio, ``services/ps/state.py``) and the simulator (SimPy,
:mod:`imerge.sim.psjob`) are two drivers of this one kernel: each tells
:class:`BlockRound` what happened to the block and carries out the actions it
returns; the payload's bytes, the optimizer and the waiting pulls stay the
driver's. What a round is, is decided here:

* :meth:`~BlockRound.offer`: a worker's push came for its row (the driver holds
  the row): a push of a row already counted in this round, or of the round
  before, is a :class:`Retry` (the driver compares its bytes with the counted
  ones); a push of another round is refused; a new one must carry the options
  the round's other pushes carried (the same hyperparameters, assignment, loss
  scale and clipping: :class:`~imerge.core.rounds.RoundOptions`), and a slot
  flag's fencing token not older than one already seen in its lane
  (:class:`Receive`; ``new_token``: the token is newer than any seen, which the
  driver checks against the store's clock).
* :meth:`~BlockRound.receive_started`: the payload goes into the row, which no longer
  holds the round that was counted there.
* :meth:`~BlockRound.counted`: the payload arrived whole and checked: the push
  counts (:class:`Counted`; its options are checked again, another push may have
  counted meanwhile); its token moves the lane's fence; the last worker's push
  starts the round's aggregation (:class:`Aggregate`, with the options and the
  pieces no worker gave a gradient).
* :meth:`~BlockRound.averaged` / :meth:`~BlockRound.agreed`: a round that clips
  by the global norm or unscales a loss scale needs the job's consensus before
  it steps: the block's averaged gradient gives its scalars (sum of squares,
  found inf: :class:`Agree`, which the shard adds to its other blocks' and
  exchanges with the other shards), and the job's totals decide the step
  (:class:`Step`: skipped where any block found an inf or NaN, clipped by the
  total norm).
* :meth:`~BlockRound.completed` / :meth:`~BlockRound.failed`: the aggregation
  stepped (:class:`Publish`: the block is at the next round, the pulls of the
  round are answered with the step's result: skipped or not, and the total
  gradient norm where the round agreed on one) or could not (:class:`Fail`:
  they fail with the reason).
* :meth:`~BlockRound.supersede`: a restore replaced the block (its pulls fail
  as stale).

A push may stand for several workers alike (``alike``: the simulator's class of
identical workers, ranks ``push.worker`` to ``push.worker + alike - 1``); the
shard's pushes are one worker each. With ``trace`` set, every event and the
actions it returned (or the refusal it raised) are recorded; :func:`replay`
feeds such a trace through a fresh kernel, so a shard's run and the simulator's
can be checked to decide alike.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Union

from .errors import FailedPrecondition, Fenced, IMergeError, InvalidArgument, StaleGeneration, Unavailable
from .rounds import Push, RoundOptions, grad_norm


# The actions: what the driver carries out.
@dataclasses.dataclass(frozen=True)
class Retry:
    """A push of a row already counted: a retry must carry the counted bytes."""
    worker: int
    counted_round: int   # the round the row holds (-1: none, it was overwritten or restored since: nothing to compare)
    counted_source: str  # the client whose push was counted


@dataclasses.dataclass(frozen=True)
class Receive:
    """A new push of the round: receive its payload into the row."""
    worker: int
    new_token: bool  # its fencing token is newer than any seen: check it against the store's clock first


@dataclasses.dataclass(frozen=True)
class Counted:
    """The push counts."""
    worker: int
    pushed: int  # workers of the round counted so far


@dataclasses.dataclass(frozen=True)
class Aggregate:
    """Every worker pushed: average the rows and step."""
    round: int
    options: RoundOptions     # the round's (every counted push carried them)
    no_grad: tuple[int, ...]  # pieces no worker gave a gradient: not stepped


@dataclasses.dataclass(frozen=True)
class Agree:
    """The block averaged: add its scalars to the job's (every block of every shard) for the round."""
    round: int
    scalars: tuple[float, bool]  # (sum of squares of the averaged gradient, found an inf or NaN)


@dataclasses.dataclass(frozen=True)
class Step:
    """The job agreed: step the block with its totals."""
    round: int
    total: tuple[float, bool]  # the job's (sum of squares, found an inf or NaN): a found inf skips the step


@dataclasses.dataclass(frozen=True)
class Publish:
    """The round stepped: the block is at ``round``; its pulls are answered."""
    round: int
    result: tuple[bool, float]  # (step skipped, gradient norm)


@dataclasses.dataclass(frozen=True)
class Fail:
    """The round cannot complete: its pulls fail with ``reason``."""
    round: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Supersede:
    """A restore replaced the block: its waiting pulls fail as stale (the job is at ``generation``)."""
    generation: int


Action = Union[Retry, Receive, Counted, Aggregate, Agree, Step, Publish, Fail, Supersede]
ACTIONS: dict[str, type[Any]] = {cls.__name__: cls for cls in (Retry, Receive, Counted, Aggregate, Agree, Step,
                                                               Publish, Fail, Supersede)}


class BlockRound:
    """One block's round: the rows counted, the lanes' fences, the round's options, its completion."""

    def __init__(self, block_id: str, num_workers: int, round_: int = 0, trace: list[dict[str, Any]] | None = None):
        self.block_id, self.num_workers = block_id, num_workers
        self.round = round_                 # completed aggregations: the round the next pushes are of
        self._pushed = 0                    # the workers counted in the round, as a bit mask
        self._receiving = 0                 # the workers whose payload is being received into their row (mask)
        self.fence: dict[int, int] = {}     # slot lane -> newest fencing token of a counted push
        self.options: RoundOptions | None = None  # what the round's counted pushes carry besides data
        self.no_grad: set[int] | None = None      # pieces no counted push gave a gradient (so far)
        self.sources: list[tuple[int, str] | None] = [None] * num_workers  # (round, client) each row counted
        self.aggregating = False
        self.scalars: tuple[float, bool] | None = None  # the block's averaged gradient's, in a round that agrees
        self.total: tuple[float, bool] | None = None    # the job's, once agreed
        self.result = (False, 0.0)          # of the round last published: (step skipped, gradient norm)
        self.failed_reason = ""             # why the current round cannot complete
        self.superseded = 0                 # the generation a restore replaced the block with
        self.trace = trace
        self._lock = threading.Lock()       # events and queries come from the event loop and connections' threads
        if trace is not None:
            trace.append({"event": "start", "block": block_id, "workers": num_workers, "round": round_})

    # -- events -------------------------------------------------------------------------------------
    def offer(self, push: Push, alike: int = 1) -> Retry | Receive:
        """A push came for its row (held by the driver): a retry of a counted row, or a new push to receive."""
        def decide() -> list[Action]:
            self._workers(push, alike)  # a worker outside the block is refused by name, not an IndexError
            if push.round == self.round - 1 or (push.round == self.round and self._pushed >> push.worker & 1):
                counted_round, counted_source = self.sources[push.worker] or (-1, "")
                return [Retry(push.worker, counted_round, counted_source)]
            if push.round != self.round:
                raise FailedPrecondition(f"{push.what}: the block's current round is {self.round}")
            self._check_options(push)
            newest = self.fence.get(push.lane, 0)
            if push.fence and push.fence < newest:
                raise Fenced(f"{push.what}: fenced: its slot flag token {push.fence} is older than token {newest} "
                             f"already seen in lane {push.lane} (the lease passed to another holder)")
            return [Receive(push.worker, push.fence > newest)]

        action = self._event("offer", decide, push=push, alike=alike)[0]
        assert isinstance(action, (Retry, Receive))
        return action

    def receive_started(self, push: Push, alike: int = 1) -> None:
        """The payload goes into the row: it no longer holds the round counted there."""
        def start() -> list[Action]:
            workers = self._workers(push, alike)
            self._receiving |= _mask(workers)
            self.sources[workers.start:workers.stop] = [None] * alike
            return []

        self._event("receive_started", start, push=push, alike=alike)

    def abandoned(self, push: Push, alike: int = 1) -> None:
        """The payload did not arrive whole, or was refused: the push is not counted."""
        def drop() -> list[Action]:
            self._receiving &= ~_mask(self._workers(push, alike))
            return []

        self._event("abandoned", drop, push=push, alike=alike)

    def counted(self, push: Push, source: str = "", alike: int = 1) -> list[Action]:
        """The payload arrived whole and checked: count the push; the last one starts the aggregation."""
        def count() -> list[Action]:
            workers = self._workers(push, alike)
            self._receiving &= ~_mask(workers)
            self._check_options(push)  # another push may have counted meanwhile
            self.options = push.options
            pieces = set(push.no_grad)
            self.no_grad = pieces if self.no_grad is None else self.no_grad & pieces
            self.fence[push.lane] = max(self.fence.get(push.lane, 0), push.fence)  # only a counted push moves it
            self.sources[workers.start:workers.stop] = [(push.round, source)] * alike
            self._pushed |= _mask(workers)
            pushed = self._pushed.bit_count()
            actions: list[Action] = [Counted(push.worker, pushed)]
            if pushed == self.num_workers:
                self.aggregating = True
                actions.append(Aggregate(self.round, self.options, tuple(sorted(self.no_grad))))
            return actions

        return self._event("counted", count, push=push, alike=alike, source=source)

    def averaged(self, round_: int, sumsq: float, found_inf: bool) -> Agree:
        """A round that needs the job's consensus averaged: its scalars go to the agreement."""
        def report() -> list[Action]:
            self._check_aggregating(round_, agreeing=True)
            if self.scalars is not None:
                raise FailedPrecondition(f"block {self.block_id}: round {round_} averaged twice")
            self.scalars = (sumsq, found_inf)
            return [Agree(round_, self.scalars)]

        action = self._event("averaged", report, round=round_, sumsq=sumsq, found_inf=found_inf)[0]
        assert isinstance(action, Agree)
        return action

    def agreed(self, round_: int, sumsq: float, found_inf: bool) -> Step:
        """The job's totals of the round: the block steps with them."""
        def step() -> list[Action]:
            self._check_aggregating(round_, agreeing=True)
            if self.scalars is None or self.total is not None:
                raise FailedPrecondition(f"block {self.block_id}: round {round_}'s totals came "
                                         f"{'before its own scalars' if self.scalars is None else 'twice'}")
            self.total = (sumsq, found_inf)
            return [Step(round_, self.total)]

        action = self._event("agreed", step, round=round_, sumsq=sumsq, found_inf=found_inf)[0]
        assert isinstance(action, Step)
        return action

    def completed(self, round_: int) -> list[Action]:
        """The round's aggregation stepped: the block is at the next round."""
        def complete() -> list[Action]:
            self._check_aggregating(round_)
            if self.options is not None and self.options.needs_agreement and self.total is None:
                raise FailedPrecondition(f"block {self.block_id}: round {round_} completed before the job agreed")
            sumsq, found_inf = self.total or (0.0, False)
            result = (found_inf, grad_norm(sumsq, found_inf) if self.total else 0.0)
            self.round, self.result, self.aggregating = round_ + 1, result, False
            self._pushed = 0
            self.options, self.no_grad, self.scalars, self.total = None, None, None, None
            return [Publish(self.round, result)]

        return self._event("completed", complete, round=round_)

    def failed(self, round_: int, reason: str) -> list[Action]:
        """The round's aggregation failed: its pulls fail with ``reason``."""
        def fail() -> list[Action]:
            self._check_aggregating(round_)
            self.failed_reason = reason
            return [Fail(round_, reason)]

        return self._event("failed", fail, round=round_, reason=reason)

    def supersede(self, generation: int) -> list[Action]:
        """A restore replaced the block: nothing of it completes any more."""
        def replace() -> list[Action]:
            self.superseded = generation
            return [Supersede(generation)]

        return self._event("supersede", replace, generation=generation)

    # -- queries (no state changes) ------------------------------------------------------------------
    def check_pull(self, worker: int, round_: int) -> None:
        """A pull names the round the block is at, or the one before."""
        round_now = self.round
        if round_ not in (round_now - 1, round_now):
            raise FailedPrecondition(f"{self._pull(worker, round_)}: the block's current round is {round_now}")

    def pulled(self, worker: int, round_: int) -> tuple[int, tuple[bool, float]] | None:
        """(the block's round, the published result) once ``round_`` completed; None while it has not."""
        with self._lock:
            superseded, round_now, result, failed = self.superseded, self.round, self.result, self.failed_reason
        if superseded:
            what = self._pull(worker, round_)
            raise StaleGeneration(f"{what}: the job moved to generation {superseded} while it waited (it "
                                  "recovered from a checkpoint): rejoin")
        if round_now > round_:
            return round_now, result
        if failed:
            raise Unavailable(f"{self._pull(worker, round_)}: {failed}")
        return None

    def _pull(self, worker: int, round_: int) -> str:
        return f"pull of block {self.block_id} by worker {worker} for round {round_}"

    @property
    def pushed(self) -> set[int]:
        """The workers counted in the round."""
        return _members(self._pushed)

    @property
    def receiving(self) -> set[int]:
        """The workers whose payload is being received into their row."""
        return _members(self._receiving)

    def missing(self) -> list[int]:
        """The workers not counted in the round."""
        return sorted(_members(~self._pushed & ((1 << self.num_workers) - 1)))

    def busy(self) -> list[int]:
        """The workers counted in, or pushing to, the round."""
        return sorted(_members(self._pushed | self._receiving))

    # -- rules -----------------------------------------------------------------------------------------
    def _workers(self, push: Push, alike: int) -> range:
        workers = range(push.worker, push.worker + alike)
        if alike < 1 or workers.start < 0 or workers.stop > self.num_workers:
            raise InvalidArgument(f"{push.what}: workers {workers.start}..{workers.stop - 1} outside "
                                  f"0..{self.num_workers - 1}")
        return workers

    def _check_options(self, push: Push) -> None:
        """Refuse options that are out of range or differ from those of the round's counted pushes."""
        push.options.check(push.what)
        disagreement = push.options.disagreement(self.options) if self.options is not None else ""
        if disagreement:
            raise FailedPrecondition(f"{push.what}: it and another worker's push of this round carry {disagreement}")

    def _check_aggregating(self, round_: int, agreeing: bool = False) -> None:
        if not self.aggregating or round_ != self.round:
            raise FailedPrecondition(f"block {self.block_id}: round {round_} is not being aggregated (the block is at "
                                     f"round {self.round}{', aggregating' if self.aggregating else ''})")
        if agreeing and not (self.options is not None and self.options.needs_agreement):
            raise FailedPrecondition(f"block {self.block_id}: round {round_} neither clips by the global norm nor "
                                     "unscales: it needs no agreement")

    # -- the trace -------------------------------------------------------------------------------------
    def _event(self, name: str, decide: Any, **args: Any) -> list[Action]:
        """Run ``decide`` (the event's rules) under the block's lock; with a trace, record the event with its
        actions or its refusal."""
        with self._lock:
            return self._decided(name, decide, args)

    def _decided(self, name: str, decide: Any, args: dict[str, Any]) -> list[Action]:
        if self.trace is None:
            result: list[Action] = decide()
            return result
        record: dict[str, Any] = {"event": name, **{k: _plain(v) for k, v in args.items()}}
        self.trace.append(record)
        try:
            result = decide()
        except IMergeError as exc:
            record["refused"] = [type(exc).__name__, str(exc)]
            raise
        record["actions"] = [_plain(action) for action in result]
        return result


def _mask(workers: range) -> int:
    return ((1 << len(workers)) - 1) << workers.start


def _members(mask: int) -> set[int]:
    return {worker for worker, bit in enumerate(reversed(bin(mask)[2:])) if bit == "1"}


def _plain(value: Any) -> Any:
    """A trace's form of an event's argument or an action: dataclasses as dicts (actions named), tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"action": type(value).__name__, **fields} if type(value).__name__ in ACTIONS else fields
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def push_of(fields: dict[str, Any]) -> Push:
    """A push from its trace form."""
    values = dict(fields)
    values["options"] = RoundOptions(**values["options"])
    values["no_grad"] = tuple(values["no_grad"])
    return Push(**values)


def replay(trace: Sequence[dict[str, Any]], like: BlockRound) -> list[dict[str, Any]]:
    """Feed the events of ``trace`` (recorded by a :class:`BlockRound` from its start) through a fresh kernel made as
    ``like`` is (its block and workers), starting at the trace's first round, and return what it decided, in the
    trace's form. The result equals ``trace`` when both decide alike."""
    fresh = BlockRound(like.block_id, like.num_workers, trace[0]["round"] if trace else like.round, trace=[])
    for event in trace[1:]:
        name = event["event"]
        try:
            if name in ("offer", "receive_started", "abandoned", "counted"):
                extra = {"source": event["source"]} if name == "counted" else {}
                getattr(fresh, name)(push_of(event["push"]), alike=event["alike"], **extra)
            elif name == "completed":
                fresh.completed(event["round"])
            elif name in ("averaged", "agreed"):
                getattr(fresh, name)(event["round"], event["sumsq"], event["found_inf"])
            elif name == "failed":
                fresh.failed(event["round"], event["reason"])
            else:
                fresh.supersede(event["generation"])
        except IMergeError:
            pass  # recorded in the fresh trace
    return fresh.trace or []
