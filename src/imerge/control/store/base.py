"""The store's connection, its blocking primitives, and what every role may read or report.

The facets of :mod:`imerge.control.store` add each role's writes to this.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Self, TypeVar

import redis

from imerge.core.planning import COST_PLAN, FIRST_PLAN
from imerge.core.config import redacted
from imerge.core.errors import JobTaken, StoreError, WaitTimeout

from ..messages import (BlocksReady, CheckpointRounds, FailureReport, GenerationEvent, JobLease, LayoutSubmission,
                        Loaded, Member, PlanPublished, Restored)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_BLOCK_SLICE_S = 5.0
FLAG_STATS = ("granted", "contended", "expired")
# What each role's Redis ACL user may do (Redis 7 key permissions): run its commands, read every key of its job,
# and write only the keys of its job that ROLE_WRITES lists (patterns under imerge:{job}:). Everything else is
# denied: no role can FLUSHALL, CONFIG, KEYS, DEBUG or touch another job; only the coordinator writes the plan,
# the generation and its events; only shards register addresses and checkpoint rounds. Lua scripts are checked
# command by command and key by key, and a key declared to a script must be writable by the caller.
_CONNECTION = ("ping", "select", "multi", "exec", "discard", "info")  # and client|setinfo where Redis has it (7.2)
ROLE_COMMANDS = {
    "coordinator": _CONNECTION + ("get", "set", "rpush", "blpop", "hgetall", "hlen", "exists", "scan", "unlink",
                                  "evalsha", "script|load"),
    "ps": _CONNECTION + ("get", "set", "hset", "rpush", "blpop", "pexpire", "time"),
    "worker": _CONNECTION + ("get", "set", "hset", "hget", "rpush", "blpop", "del", "exists", "pttl", "pexpire",
                             "hincrby", "time", "evalsha", "script|load"),
}
_LATCHES = "event:*[0-9]"  # every event's latch list (names end in a number; their values end in ":value"):
# a waiter pops the token and pushes it back
ROLE_WRITES = {
    "coordinator": ("*",),
    "ps": ("shards", "shards:queue", "shard:*", "checkpoints", "failures:queue", "scalars:*", _LATCHES,
           "event:restored:*"),
    "worker": ("workers", "worker:*", "layout:*", "layouts:queue", "done", "done:queue", "positions", "loading",
               "profile",
               "profile:queue", "windows:queue", "buffers:*", "flag:*", "flags:stats", "failures:queue", _LATCHES,
               "event:blocks-ready:*", "event:loaded:*"),
}
ACL_MIN_REDIS = (7, 0)  # %R~ (read-only) key permissions


def _text(value: bytes | str) -> str:
    """A reply of the store's connection (made with decode_responses: always text)."""
    return value if isinstance(value, str) else value.decode()


def _slice(seconds: float) -> float:
    """A BLPOP timeout: at most one slice, and never below 10 ms (Redis reads a timeout under 1 ms as 0, which
    blocks forever)."""
    return min(max(seconds, 0.01), _BLOCK_SLICE_S)


def _translated(method: F) -> F:
    """Turn any Redis failure of ``method`` into a StoreError naming the server."""

    @functools.wraps(method)
    def wrapper(self: "StoreBase", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {redacted(self.url)}: {method.__name__} failed: {exc}") from exc

    return wrapper  # type: ignore[return-value]


class StoreBase:
    """A connection to the job's keys: the reads every role makes, and its failure reports."""

    def __init__(self, url: str, job: str, *, socket_timeout_s: float = 10.0):
        self.url = url
        self.job = job
        self._socket_timeout_s = socket_timeout_s
        self._prefix = f"imerge:{job}:"
        self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s + _BLOCK_SLICE_S,
                                           socket_connect_timeout=socket_timeout_s,
                                           decode_responses=True)

    def _key(self, *parts: object) -> str:
        return self._prefix + ":".join(str(p) for p in parts)

    @_translated
    def ping(self) -> None:
        self._redis.ping()

    def close(self) -> None:
        self._redis.close()

    def another_connection(self) -> Self:
        """A second connection to the same job's keys, with the same timeouts: for a thread that blocks in
        Redis, so that closing it ends that wait (closing this one would end every caller's)."""
        return type(self)(self.url, self.job, socket_timeout_s=self._socket_timeout_s)

    # -- blocking primitives ------------------------------------------------
    def _pop(self, key: str, deadline: float, what: str, timeout_s: float) -> str:
        """BLPOP one item of ``key`` before ``deadline`` (monotonic)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}")
            item = self._redis.blpop([key], timeout=_slice(remaining))
            if item is not None:
                return _text(item[1])

    def _collect(self, queue: str, count: int, timeout_s: float, what: str) -> None:
        """Pop indexes from ``queue`` until each of 0..count-1 was seen; others are logged and skipped."""
        deadline = time.monotonic() + timeout_s
        seen: set[int] = set()
        while len(seen) < count:
            missing = sorted(set(range(count)) - seen)
            index = int(self._pop(self._key(queue, "queue"), deadline, what.format(missing=missing), timeout_s))
            if 0 <= index < count:
                seen.add(index)
            else:
                log.warning("%s %d registered but the job has only %d; ignored", queue, index, count)

    def _set_event(self, name: str, value: str) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self._key("event", name, "value"), value)
        pipe.rpush(self._key("event", name), "1")
        pipe.execute()

    def _wait_event(self, name: str, timeout_s: float, what: str) -> str:
        """Block until event ``name`` is set; return its payload. The payload is looked at before each wait on the
        latch (at least every second): a latch token lost by a waiter that died between taking and putting it
        back delays the others by a second at most, never forever."""
        latch, value_key = self._key("event", name), self._key("event", name, "value")
        deadline = time.monotonic() + timeout_s
        while True:
            value = self._redis.get(value_key)
            if value is not None:
                return _text(value)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}")
            if self._redis.blpop([latch], timeout=min(_slice(remaining), 1.0)) is not None:
                self._redis.rpush(latch, "1")  # re-arm the latch for other waiters

    def _read_event(self, name: str) -> str | None:
        """The payload of event ``name`` if it is set, without waiting."""
        value = self._redis.get(self._key("event", name, "value"))
        return None if value is None else _text(value)

    # -- the plan ---------------------------------------------------------------
    @_translated
    def wait_plan(self, version: int, timeout_s: float, what: str) -> PlanPublished:
        return PlanPublished.decode(self._wait_event(f"plan:{version}", timeout_s, what))

    @_translated
    def read_plan(self, version: int) -> PlanPublished | None:
        """The plan of ``version`` if it was published, without waiting."""
        payload = self._read_event(f"plan:{version}")
        return PlanPublished.decode(payload) if payload else None

    def latest_plan(self) -> PlanPublished | None:
        """The newest published plan (the cost plan once there is one, a re-tuned one after it), without waiting."""
        first = self.read_plan(FIRST_PLAN)
        if first is None or first.plan is None:
            return first
        return self.read_plan(self.latest_version()) or self.read_plan(COST_PLAN) or first

    @_translated
    def latest_version(self) -> int:
        """The newest published plan's version (0: none yet)."""
        return int(self._redis.get(self._key("plan", "latest")) or 0)

    @_translated
    def wait_blocks_ready(self, version: int, timeout_s: float) -> BlocksReady:
        return BlocksReady.decode(self._wait_event(f"blocks-ready:{version}", timeout_s,
                                                   "worker 0 to initialize the blocks on the shards"))

    @_translated
    def job_running(self) -> bool:
        """Whether worker 0 created the first plan's blocks: a worker that joins now rejoins a running job."""
        return self._read_event(f"blocks-ready:{FIRST_PLAN}") is not None

    # -- shards -------------------------------------------------------------
    @_translated
    def registered_shards(self) -> int:
        return int(self._redis.hlen(self._key("shards")))

    # -- workers ------------------------------------------------------------
    @_translated
    def layouts(self, world_size: int) -> dict[int, LayoutSubmission]:
        """The submitted layouts, without waiting (for a coordinator that restarts mid-job)."""
        pipe = self._redis.pipeline()
        for rank in range(world_size):
            pipe.get(self._key("layout", rank))
        return {rank: LayoutSubmission.decode(text) for rank, text in enumerate(pipe.execute()) if text}

    @_translated
    def departed(self, ranks: set[int]) -> set[int]:
        """Those of ``ranks`` that hold no rank lease and no liveness key: gone (left, or dead past the TTL)."""
        ordered = sorted(ranks)
        pipe = self._redis.pipeline()
        for rank in ordered:
            pipe.get(self._key("worker", rank, "lease"))
            pipe.get(self._key("worker", rank, "alive"))
        values = pipe.execute()
        return {rank for index, rank in enumerate(ordered) if values[2 * index] is None and values[2 * index + 1]
                is None}

    @_translated
    def done_ranks(self) -> set[int]:
        """Ranks that finished their job (for a coordinator that restarts mid-job)."""
        return {int(rank) for rank in self._redis.hgetall(self._key("done"))}

    @_translated
    def worker_generation(self, rank: int) -> int | None:
        value = self._redis.get(self._key("worker", rank, "generation"))
        return None if value is None else int(value)

    # -- imerge.load ------------------------------------------------------------
    @_translated
    def loading(self, generation: int) -> bool:
        """Whether worker 0 announced an import of ``generation`` and has not ended it."""
        return self._redis.get(self._key("loading")) == str(generation)

    @_translated
    def wait_loaded(self, generation: int, sequence: int, timeout_s: float) -> Loaded:
        return Loaded.decode(self._wait_event(f"loaded:{generation}:{sequence}", timeout_s,
                                              f"worker 0 to load the saved state (imerge.load #{sequence})"))

    # -- slot flags -------------------------------------------------------------
    @_translated
    def clock_us(self) -> int:
        """Redis' clock in microseconds: what the slot flags' fencing tokens are issued from."""
        seconds, microseconds = self._redis.time()
        return int(seconds) * 1_000_000 + int(microseconds)

    @_translated
    def flag_stats(self) -> dict[str, int]:
        """How many flags were granted, granted after a wait, and released after their lease expired."""
        raw = self._redis.hgetall(self._key("flags", "stats"))
        return {name: int(raw.get(name, 0)) for name in FLAG_STATS}

    # -- which run holds the job's name ---------------------------------------------------
    @_translated
    def job_lease(self) -> JobLease | None:
        text = self._redis.get(self._key("lease"))
        return JobLease.decode(_text(text)) if text else None

    def check_job(self, token: str, what: str) -> None:
        """JobTaken where another run's token holds the job's name (``token`` empty: nothing to tell apart)."""
        held = self.job_lease() if token else None
        if held is not None and held.token != token:
            raise JobTaken(held.refusal(self.job, what))

    # -- the job's end, and a fresh start -------------------------------------------
    @_translated
    def finished_at(self) -> float | None:
        """When the job finished (epoch seconds), or None."""
        value = self._redis.get(self._key("finished"))
        return None if value is None else float(value)

    # -- generations and recovery ------------------------------------------------
    @_translated
    def generation(self) -> int | None:
        """The job generation; None when the key is absent (no plan yet, or Redis lost the job's state)."""
        value = self._redis.get(self._key("generation"))
        return None if value is None else int(value)

    @_translated
    def generation_event(self, generation: int) -> GenerationEvent | None:
        """The event that started ``generation``, if it was published."""
        payload = self._read_event(f"generation:{generation}")
        return GenerationEvent.decode(payload) if payload else None

    @_translated
    def wait_generation(self, generation: int, timeout_s: float, what: str) -> GenerationEvent:
        return GenerationEvent.decode(self._wait_event(f"generation:{generation}", timeout_s, what))

    @_translated
    def wait_restored(self, generation: int, shard: int, timeout_s: float) -> Restored:
        return Restored.decode(self._wait_event(f"restored:{generation}:{shard}", timeout_s,
                                                f"shard {shard} to restore generation {generation}"))

    @_translated
    def member_generations(self, num_workers: int, num_shards: int) -> dict[Member, int]:
        """The generation each live member's heartbeat names."""
        members = [Member.worker(r) for r in range(num_workers)] + [Member.shard(i) for i in range(num_shards)]
        pipe = self._redis.pipeline()
        for member in members:
            pipe.get(self._key(member.kind, member.index, "alive"))
        return {member: int(value) for member, value in zip(members, pipe.execute()) if value is not None}

    @_translated
    def checkpoint_rounds(self) -> dict[int, list[int]]:
        """Each shard's complete checkpoint rounds, as it last published them."""
        return {int(k): CheckpointRounds.decode(_text(v)).rounds
                for k, v in self._redis.hgetall(self._key("checkpoints")).items()}

    @_translated
    def report_failure(self, report: FailureReport) -> None:
        self._redis.rpush(self._key("failures", "queue"), report.encode())
