"""The typed messages the roles exchange through the store (Redis), each with one encoder and one decoder.

Pure: imports neither grpc nor redis. Every message is a frozen dataclass;
``encode()`` gives the text the store writes and ``decode(text)`` rebuilds the
message or raises :class:`StoreError` naming the message kind, so a malformed
or foreign value never turns into a half-read message.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any, TypeVar

from imerge.core.errors import ConfigError, JobFailed, LayoutMismatchError, PlanError, StoreError
from imerge.core.planning import Layout, Plan, PlanOptions
from imerge.core.rounds import grad_norm
from imerge.core.schedule_config import ScheduleConfig

M = TypeVar("M", bound="Message")



class Message:
    """JSON of the dataclass's fields; subclasses with nested values override ``_to_dict``/``_from_dict``."""

    def _to_dict(self) -> dict[str, Any]:
        fields: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        return fields

    @classmethod
    def _from_dict(cls: type[M], raw: dict[str, Any]) -> M:
        return cls(**raw)

    def encode(self) -> str:
        return json.dumps(self._to_dict())

    @classmethod
    def decode(cls: type[M], text: str) -> M:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError(f"expected an object, got {type(raw).__name__}")
            return cls._from_dict(raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"malformed {cls.__name__} message in the store: {exc}: {text[:200]!r}") from None


@dataclasses.dataclass(frozen=True)
class PlanPublished(Message):
    """The coordinator's plan of one version, or why it could not make one."""

    plan: Plan | None = None
    error: str = ""
    layout_mismatch: bool = False

    def _to_dict(self) -> dict[str, Any]:
        if self.plan is not None:
            plan: dict[str, Any] = json.loads(self.plan.to_json())
            return plan
        return {"error": self.error, "kind": "layout-mismatch" if self.layout_mismatch else "plan"}

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "PlanPublished":
        if "error" in raw:
            return cls(error=str(raw["error"]), layout_mismatch=raw.get("kind") == "layout-mismatch")
        return cls(plan=Plan.from_json(json.dumps(raw)))

    def result(self) -> Plan:
        """The plan, or the coordinator's error raised as the class it was."""
        if self.plan is None:
            raise (LayoutMismatchError if self.layout_mismatch else PlanError)(self.error)
        return self.plan


@dataclasses.dataclass(frozen=True)
class BlocksReady(Message):
    """Worker 0 created every block of a plan on the shards (the job is running), or why it could not."""

    error: str = ""


@dataclasses.dataclass(frozen=True)
class Loaded(Message):
    """Worker 0 imported an imerge.load file into the shards (``metadata``: the file's, JSON), or why not."""

    error: str = ""
    metadata: str = ""


@dataclasses.dataclass(frozen=True)
class GenerationEvent(Message):
    """Generation ``generation`` starts: every shard restores the checkpoint of ``round``. Generation 0
    carries the run's id; an event with an ``error`` says the job cannot recover."""

    generation: int
    round: int | None = None
    reason: str = ""
    run: str = ""
    error: str = ""

    def check(self) -> "GenerationEvent":
        if self.error:
            raise JobFailed(f"the job cannot recover: {self.error}")
        return self


@dataclasses.dataclass(frozen=True)
class Restored(Message):
    """A shard serves ``generation`` (restored from its checkpoint), or why it could not."""

    generation: int
    shard: int
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Flag:
    """A slot flag, in one plan version. Scope ``group``: the flag of one fusion group's pushes to one shard
    (it serializes exactly the pushes of that group that compete for that shard's port; a group spread over
    every shard serializes nobody). Scope ``shard`` (``group`` is PORT): the flag of the shard's port, taken
    by every push to that shard. ``lane``: with a slot width k, worker w takes lane w mod k, so that up to k
    workers hold the same slot at once."""

    plan_version: int
    group: int
    shard: int
    lane: int = 0

    def __str__(self) -> str:
        where = "port" if self.group == PORT else str(self.group)
        return f"{self.plan_version}:{where}:{self.shard}" + (f":{self.lane}" if self.lane else "")


PORT = -1  # Flag.group of a flag scoped to a shard's port


@dataclasses.dataclass(frozen=True)
class FlagGrant:
    """A slot flag was granted: whether the taker had to wait for another holder, and its fencing token."""

    contended: bool
    fence: int


@dataclasses.dataclass(frozen=True)
class FailureReport(Message):
    """A process saw the job fail in ``generation``. ``fatal``: no recovery can fix it (end the job)."""

    generation: int
    who: str
    reason: str
    fatal: bool = False

    def __str__(self) -> str:
        return f"{self.who}: {self.reason}"


    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "FailureReport":
        report = cls(**raw)
        if type(report.generation) is not int or report.generation < 0:  # noqa: E721 - bool is not a generation
            raise TypeError(f"generation must be an integer >= 0, got {report.generation!r}")
        if not isinstance(report.who, str) or not isinstance(report.reason, str) or type(report.fatal) is not bool:
            raise TypeError("who and reason must be strings and fatal a boolean")
        return report


@dataclasses.dataclass(frozen=True)
class WorkerDone:
    """Worker ``rank`` finished its job (the store holds the rank's decimal digits)."""

    rank: int

    @classmethod
    def decode(cls, text: str) -> "WorkerDone":
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise StoreError(f"malformed WorkerDone message in the store: not a rank: {text[:200]!r}")
        return cls(int(text))


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A report that did not decode (written by a buggy or hostile client): what it said and why it was refused."""

    queue: str
    why: str


@dataclasses.dataclass(frozen=True)
class WorkerInfo(Message):
    host: str
    pid: int


@dataclasses.dataclass(frozen=True)
class JobLease(Message):
    """Which run holds a job's name: its token (one per ``imerge launch`` or chart release), and the coordinator
    that keeps renewing it."""

    token: str
    holder: str  # host:pid of that coordinator

    def refusal(self, job: str, what: str) -> str:
        """Why ``what`` of another run must not touch the job this lease holds."""
        return (f"job {job} is running in this Redis under another run (its coordinator on {self.holder} holds "
                f"the job's lease): {what} would take that job's queues and overwrite its addresses. Give this "
                "run another --job, or wait until that one finished")


@dataclasses.dataclass(frozen=True)
class WorkerPosition(Message):
    """The generation a worker joined and its data position (iterations done)."""

    iteration: int
    generation: int


@dataclasses.dataclass(frozen=True)
class LayoutSubmission(Message):
    """What a worker submits: its model layout, the scheduling options the plan depends on, and its whole schedule
    (worker 0's is the base the coordinator's tuner starts from; its host-local paths are left out)."""

    layout: Layout
    options: PlanOptions
    schedule: ScheduleConfig | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None:  # a WorkerConfig's schedule fields, without its host-local paths
            fields = {f.name: getattr(self.schedule, f.name) for f in dataclasses.fields(ScheduleConfig)}
            object.__setattr__(self, "schedule", ScheduleConfig(**{**fields, "profile_out": "", "trace_dir": ""}))

    def _to_dict(self) -> dict[str, Any]:
        raw = {"layout": json.loads(self.layout.to_json()), "options": dataclasses.asdict(self.options)}
        if self.schedule is not None:
            raw["schedule"] = dataclasses.asdict(self.schedule)
        return raw

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "LayoutSubmission":
        schedule = raw.get("schedule")
        try:
            base = ScheduleConfig(**schedule) if isinstance(schedule, dict) else None
        except ConfigError as exc:
            raise ValueError(f"schedule: {exc}") from None
        return cls(Layout.from_json(json.dumps(raw["layout"])), PlanOptions(**raw["options"]), base)


@dataclasses.dataclass(frozen=True)
class Profile(Message):
    """Worker 0's profile for ``--fusion cost`` and ``--tune``: when each unit's gradient is ready, its bytes, the
    push cost, and (for the tuner's simulation) each unit's forward time and the profiled iterations' mean time."""

    ready_s: list[float]
    unit_bytes: list[int]
    alpha_s: float
    beta_s_per_byte: float
    forward_s: list[float] = dataclasses.field(default_factory=list)  # empty: not measured
    iteration_s: float = 0.0  # a profiled iteration's mean wall time, waits included (0: not measured)

    def __post_init__(self) -> None:
        if self.forward_s and len(self.forward_s) != len(self.ready_s):
            raise ValueError(f"{len(self.forward_s)} forward times for {len(self.ready_s)} units")
        if not (isinstance(self.iteration_s, (int, float)) and math.isfinite(self.iteration_s)
                and self.iteration_s >= 0):
            raise ValueError(f"iteration_s must be finite and >= 0, not {self.iteration_s!r}")

    @property
    def compute_s(self) -> float:
        """The profiled compute per iteration: every unit's forward and the backward (waits not counted)."""
        return sum(self.forward_s) + (self.ready_s[-1] if self.ready_s else 0.0)

    def backward_s(self) -> list[float]:
        """Each unit's backward time (the ready times' increments)."""
        return [b - a for a, b in zip([0.0] + self.ready_s[:-1], self.ready_s)]

    def remeasured(self, window: "Window") -> "Profile":
        """This profile under a window's measurement (online re-tuning): every unit's compute scaled to the window's
        compute time, and the push cost the window fitted where it timed enough pushes. Its iteration time is
        dropped: the window's was measured on another schedule than the profile's (plan v1's)."""
        profiled = self.compute_s
        scale = window.compute_s / profiled if profiled > 0 and window.compute_s > 0 else 1.0
        fitted = window.beta_s_per_byte > 0
        return dataclasses.replace(self, ready_s=[t * scale for t in self.ready_s],
                                   forward_s=[t * scale for t in self.forward_s],
                                   alpha_s=window.alpha_s if fitted else self.alpha_s,
                                   beta_s_per_byte=window.beta_s_per_byte if fitted else self.beta_s_per_byte,
                                   iteration_s=0.0)


@dataclasses.dataclass(frozen=True)
class Window(Message):
    """Worker 0's measurement of ``--retune-window`` iterations after the plan switch (online re-tuning): the mean
    iteration time, the part of it the forwards waited for parameters, and the push cost fitted over the window's
    pushes (0, 0 where too few were timed)."""

    generation: int
    plan: int  # the plan version the window ran on
    iteration: int  # the window's last iteration
    iteration_s: float
    forward_wait_s: float
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        numbers = (self.iteration_s, self.forward_wait_s, self.alpha_s, self.beta_s_per_byte)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in numbers):
            raise ValueError(f"window times must be finite and >= 0: {numbers}")
        if min(self.generation, self.plan, self.iteration) < 0:
            raise ValueError("generation, plan and iteration must be >= 0")

    @property
    def compute_s(self) -> float:
        """The iteration's time without its forward waits."""
        return max(0.0, self.iteration_s - self.forward_wait_s)


@dataclasses.dataclass(frozen=True)
class CheckpointRounds(Message):
    """The rounds of a shard's complete checkpoints."""

    rounds: list[int]


def common_round(rounds_by_shard: dict[int, list[int]], num_shards: int) -> int | None:
    """The newest checkpoint round every shard 0..num_shards-1 holds (as each published its
    :class:`CheckpointRounds`), or None: the round a recovery restores."""
    if num_shards < 1 or any(shard not in rounds_by_shard for shard in range(num_shards)):
        return None
    common = set.intersection(*(set(rounds_by_shard[shard]) for shard in range(num_shards)))
    return max(common) if common else None


@dataclasses.dataclass(frozen=True, order=True)
class Member:
    """A member of the job whose heartbeat the coordinator watches: ``worker 0``, ``shard 1``."""

    kind: str   # "worker" or "shard"
    index: int

    KINDS = ("worker", "shard")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS or not isinstance(self.index, int) or self.index < 0:
            raise StoreError(f"malformed member ({self.kind!r}, {self.index!r}): a worker or shard and an index")

    @classmethod
    def worker(cls, rank: int) -> "Member":
        return cls("worker", rank)

    @classmethod
    def shard(cls, index: int) -> "Member":
        return cls("shard", index)

    @classmethod
    def parse(cls, text: str) -> "Member":
        kind, _, index = text.partition(" ")
        if not index.isdigit():
            raise StoreError(f"malformed member {text[:40]!r}: expected 'worker N' or 'shard N'")
        return cls(kind, int(index))

    def __str__(self) -> str:
        return f"{self.kind} {self.index}"


@dataclasses.dataclass(frozen=True)
class RoundScalars(Message):
    """What averaged gradients hold that the step of every block depends on (the shards agree on their sum)."""

    sumsq: float = 0.0       # sum of squares (float64) of the averaged, unscaled gradient
    found_inf: bool = False  # some element is infinite or NaN

    def __post_init__(self) -> None:
        if not isinstance(self.sumsq, (int, float)) or isinstance(self.sumsq, bool) \
                or not isinstance(self.found_inf, bool):
            raise TypeError(f"sumsq must be a number and found_inf a bool, got {self.sumsq!r}, {self.found_inf!r}")

    def plus(self, other: "RoundScalars") -> "RoundScalars":
        return RoundScalars(self.sumsq + other.sumsq, self.found_inf or other.found_inf)

    @property
    def grad_norm(self) -> float:
        return grad_norm(self.sumsq, self.found_inf)


@dataclasses.dataclass(frozen=True)
class PostedScalars(Message):
    """One shard's :class:`RoundScalars` of a round, as it posts them to every shard holding blocks."""

    shard: int
    scalars: RoundScalars

    def _to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "sumsq": self.scalars.sumsq, "found_inf": self.scalars.found_inf}

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "PostedScalars":
        if not isinstance(raw["shard"], int):
            raise TypeError(f"shard must be an int, got {raw['shard']!r}")
        return cls(raw["shard"], RoundScalars(raw["sumsq"], raw["found_inf"]))


@dataclasses.dataclass(frozen=True)
class RankHolder:
    """Who holds a rank's lease: a process (host, pid) and a nonce of its claim. Its ``token`` is the lease's
    value before the beat count (the store's scripts compare the ``token + ' '`` prefix)."""

    host: str
    pid: int
    nonce: str

    def __post_init__(self) -> None:
        if ":" in self.host or " " in self.host or not self.nonce.isalnum():
            raise StoreError(f"malformed rank holder {self.host!r}/{self.nonce!r}")

    @property
    def token(self) -> str:
        return f"{self.host}:{self.pid}:{self.nonce}"

    def __str__(self) -> str:
        return self.token


@dataclasses.dataclass(frozen=True)
class RankLeaseValue:
    """A rank lease as the store keeps it: ``host:pid:nonce beats`` (beats: renewals so far)."""

    holder: RankHolder
    beats: int = 0

    def encode(self) -> str:
        return f"{self.holder.token} {self.beats}"

    @classmethod
    def decode(cls, text: str) -> "RankLeaseValue":
        token, _, beats = text.rpartition(" ")
        host, pid, nonce = (token.split(":") + ["", "", ""])[:3]
        if not (pid.isdigit() and beats.isdigit() and host and nonce):
            raise StoreError(f"malformed rank lease {text[:80]!r}: expected 'host:pid:nonce beats'")
        return cls(RankHolder(host, int(pid), nonce), int(beats))


@dataclasses.dataclass(frozen=True)
class ModuleState(Message):
    """Model buffers (and frozen parameters) a worker publishes: safetensors bytes, base64 in the store."""

    data: bytes = b""

    def _to_dict(self) -> dict[str, Any]:
        return {"safetensors": base64.b64encode(self.data).decode()}

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "ModuleState":
        return cls(base64.b64decode(raw["safetensors"], validate=True))
