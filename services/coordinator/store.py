"""The coordinator's store: the only module in IMerge that issues Redis commands.

Every role (coordinator, shards, workers) reaches Redis through :class:`Store`.
Redis failures are translated into :class:`StoreError` here, at one choke
point. Blocking waits use blocking list pops (never loops of GETs), are cut in
slices of at most ``_BLOCK_SLICE_S`` seconds so that a dead Redis is noticed,
and end with :class:`WaitTimeout` naming what they waited for.

Key layout (all under ``imerge:{job}:``):

==========================  =======  ==============================================
key                         type     meaning
==========================  =======  ==============================================
``shards``                  hash     shard index -> advertised gRPC address
``shards:queue``            list     shard indexes, pushed on each registration
``workers``                 hash     worker rank -> JSON {host, pid}
``worker:{rank}:alive``     string   heartbeat: the generation the worker serves (-1 while joining),
                                     expires after the heartbeat TTL
``layout:{rank}``           string   the worker's model layout (JSON, see planning)
``layouts:queue``           list     ranks, pushed when a layout is submitted
``event:{name}``            list     a latch: holds one token once the event is set
``event:{name}:value``      string   the event's payload
``done:queue``              list     ranks, pushed when a worker finished its job
``done``                    hash     rank -> 1 once the worker finished (read by a restarted coordinator)
``profile``                 string   worker 0's profile for ``--fusion cost`` (JSON)
``profile:queue``           list     a token, pushed when the profile is submitted
``flag:{v}:{g}``            string   holder token of group g's slot flag (plan v), with
                                     the lease as its expiry; absent = free
``flag:{v}:{g}:wake``       list     one token pushed by each release, to wake a waiter
``flags:stats``             hash     granted / contended (granted after a wait) / expired
                                     (released after the lease had passed) flag counts
``fence``                   string   the last fencing token handed out with a flag (INCR)
``generation``              string   the job generation (absent until the plan is published;
                                     its loss means Redis lost the job's state)
``shard:{i}:alive``         string   a shard's heartbeat: the generation it serves; expires after its TTL
``checkpoints``             hash     shard index -> JSON list of its complete checkpoint rounds
``failures:queue``          list     JSON {generation, who, reason}: a process saw a peer fail
``worker:{rank}:generation`` string  the generation the worker last joined
``positions``               hash     worker rank -> JSON {iteration, generation}: data position
==========================  =======  ==============================================

Events in use: ``plan:{version}`` (payload: the plan JSON, or ``{"error": ...}``),
``blocks-ready:{version}`` (rank 0 initialized every block of that plan),
``generation:{g}`` (payload: JSON {generation, round, reason}: recover from the
checkpoint of that round) and ``restored:{g}:{shard}`` (the shard serves g).

Slot flags are leases: taking one is one Lua call (set the holder with an
expiry if absent); a worker that finds it taken blocks on the wake list with
BLPOP for at most the holder's remaining lease, then tries again, so a dead
holder frees the flag when its lease expires and nobody polls. Releasing is a
Lua compare-and-delete on the holder token, so a late release by an old
holder never frees a newer holder's flag.
A latch is waited on with BLPOP and the token is pushed back at once, so any
number of waiters see it, now or later.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from imerge.config import redacted
from imerge.errors import GenerationChanged, StoreError, WaitTimeout

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_BLOCK_SLICE_S = 5.0
_ACQUIRE = """
local generation = redis.call('GET', KEYS[5]) or '0'
if generation ~= ARGV[4] then return {-1, tonumber(generation)} end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('DEL', KEYS[2])
  redis.call('HINCRBY', KEYS[3], 'granted', 1)
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'contended', 1) end
  return {1, redis.call('INCR', KEYS[4])}
end
return {0, redis.call('PTTL', KEYS[1])}
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  return 1
end
redis.call('HINCRBY', KEYS[3], 'expired', 1)
return 0
"""
FLAG_STATS = ("granted", "contended", "expired")
# What each role's Redis ACL user may run (on the job's keys only); everything else is denied, so no
# role can FLUSHALL, CONFIG, KEYS, DEBUG or touch another job. Lua scripts are checked command by command.
_CONNECTION = ("ping", "select", "client|setinfo", "multi", "exec", "discard")
ROLE_COMMANDS = {
    "coordinator": _CONNECTION + ("get", "set", "rpush", "blpop", "hgetall", "hlen", "exists"),
    "ps": _CONNECTION + ("get", "set", "hset", "rpush", "blpop"),
    "worker": _CONNECTION + ("get", "set", "hset", "rpush", "blpop", "del", "exists", "pttl", "hincrby", "incr",
                             "evalsha", "eval", "script|load"),
}



def _slice(seconds: float) -> float:
    """A BLPOP timeout: at most one slice, and never below 10 ms (Redis reads a timeout under 1 ms as 0, which
    blocks forever)."""
    return min(max(seconds, 0.01), _BLOCK_SLICE_S)


def _translated(method: F) -> F:
    """Turn any Redis failure of ``method`` into a StoreError naming the server."""

    @functools.wraps(method)
    def wrapper(self: "Store", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {redacted(self.url)}: {method.__name__} failed: {exc}") from exc

    return wrapper  # type: ignore[return-value]


class Store:
    def __init__(self, url: str, job: str, *, socket_timeout_s: float = 10.0):
        self.url = url
        self.job = job
        self._prefix = f"imerge:{job}:"
        self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s + _BLOCK_SLICE_S,
                                           socket_connect_timeout=socket_timeout_s,
                                           decode_responses=True)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)

    def key(self, *parts: object) -> str:
        return self._prefix + ":".join(str(p) for p in parts)

    @_translated
    def ping(self) -> None:
        self._redis.ping()

    def close(self) -> None:
        self._redis.close()

    # -- blocking primitives ------------------------------------------------
    def _pop(self, key: str, deadline: float, what: str, timeout_s: float) -> str:
        """BLPOP one item of ``key`` before ``deadline`` (monotonic)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}")
            item = self._redis.blpop([key], timeout=_slice(remaining))
            if item is not None:
                return item[1]

    def _collect(self, queue: str, count: int, timeout_s: float, what: str) -> None:
        """Pop indexes from ``queue`` until each of 0..count-1 was seen; others are logged and skipped."""
        deadline = time.monotonic() + timeout_s
        seen: set[int] = set()
        while len(seen) < count:
            missing = sorted(set(range(count)) - seen)
            index = int(self._pop(self.key(queue, "queue"), deadline, what.format(missing=missing), timeout_s))
            if 0 <= index < count:
                seen.add(index)
            else:
                log.warning("%s %d registered but the job has only %d; ignored", queue, index, count)

    @_translated
    def set_event(self, name: str, value: str) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self.key("event", name, "value"), value)
        pipe.rpush(self.key("event", name), "1")
        pipe.execute()

    @_translated
    def wait_event(self, name: str, timeout_s: float, what: str) -> str:
        """Block until event ``name`` is set; return its payload."""
        self._pop(self.key("event", name), time.monotonic() + timeout_s, what, timeout_s)
        self._redis.rpush(self.key("event", name), "1")  # re-arm the latch for other waiters
        return self._redis.get(self.key("event", name, "value")) or ""

    @_translated
    def read_event(self, name: str) -> str | None:
        """The payload of event ``name`` if it is set, without waiting."""
        return self._redis.get(self.key("event", name, "value"))

    # -- shards -------------------------------------------------------------
    @_translated
    def register_shard(self, index: int, address: str) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self.key("shards"), str(index), address)
        pipe.rpush(self.key("shards", "queue"), str(index))
        pipe.execute()

    @_translated
    def wait_shards(self, count: int, timeout_s: float) -> list[str]:
        """Addresses of shards 0..count-1, once all of them registered."""
        self._collect("shards", count, timeout_s, "PS shards {missing} to register")
        addresses = self._redis.hgetall(self.key("shards"))
        return [addresses[str(i)] for i in range(count)]

    # -- workers ------------------------------------------------------------
    @_translated
    def register_worker(self, rank: int, info: dict[str, Any], ttl_s: float) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self.key("workers"), str(rank), json.dumps(info))
        pipe.set(self.key("worker", rank, "alive"), "-1", px=int(ttl_s * 1000))
        pipe.execute()

    @_translated
    def heartbeat(self, rank: int, ttl_s: float, generation: int = -1) -> None:
        self._redis.set(self.key("worker", rank, "alive"), str(generation), px=int(ttl_s * 1000))

    @_translated
    def submit_layout(self, rank: int, layout_json: str) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self.key("layout", rank), layout_json)
        pipe.rpush(self.key("layouts", "queue"), str(rank))
        pipe.execute()

    @_translated
    def wait_layouts(self, world_size: int, timeout_s: float) -> dict[int, str]:
        self._collect("layouts", world_size, timeout_s, "workers {missing} to submit their model layout")
        return self.layouts(world_size)

    @_translated
    def mark_done(self, rank: int) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self.key("done"), str(rank), "1")
        pipe.rpush(self.key("done", "queue"), str(rank))
        pipe.execute()

    @_translated
    def done_ranks(self) -> set[int]:
        """Ranks that finished their job (for a coordinator that restarts mid-job)."""
        return {int(rank) for rank in self._redis.hgetall(self.key("done"))}

    @_translated
    def layouts(self, world_size: int) -> dict[int, str]:
        """The submitted layouts, without waiting (for a coordinator that restarts mid-job)."""
        pipe = self._redis.pipeline()
        for rank in range(world_size):
            pipe.get(self.key("layout", rank))
        return dict(enumerate(pipe.execute()))

    # -- profile (fusion cost) ------------------------------------------------
    @_translated
    def submit_profile(self, payload: str) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self.key("profile"), payload)
        pipe.rpush(self.key("profile", "queue"), "1")
        pipe.execute()

    @_translated
    def wait_profile(self, timeout_s: float) -> str:
        self._pop(self.key("profile", "queue"), time.monotonic() + timeout_s,
                  "worker 0's profile of its first iterations", timeout_s)
        return self._redis.get(self.key("profile")) or ""

    # -- slot flags -------------------------------------------------------------
    @_translated
    def acquire_flag(self, name: str, token: str, lease_s: float, timeout_s: float,
                     generation: int = 0) -> tuple[bool, int]:
        """Take flag ``name`` for ``token`` in ``generation``; block (no polling) while another holds it.

        Returns (whether the flag was contended, its fencing token); WaitTimeout names the holder,
        GenerationChanged says the job moved on.
        """
        holder, wake = self.key("flag", name), self.key("flag", name, "wake")
        deadline = time.monotonic() + timeout_s
        contended = False
        while True:
            outcome, value = self._acquire(keys=[holder, wake, self.key("flags", "stats"), self.key("fence"),
                                                 self.key("generation")],
                                           args=[token, int(lease_s * 1000), int(contended), generation])
            if outcome == -1:
                raise GenerationChanged(f"slot flag {name}: the job is at generation {value}, not {generation}",
                                        value)
            if outcome == 1:
                return contended, value
            remaining_lease_ms = value
            contended = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for slot flag {name} "
                                  f"(held by {self._redis.get(holder)})")
            wait = min(remaining, max(remaining_lease_ms, 10) / 1000, _BLOCK_SLICE_S)
            self._redis.blpop([wake], timeout=_slice(wait))

    @_translated
    def release_flag(self, name: str, token: str) -> bool:
        """Free flag ``name`` if ``token`` still holds it; False if its lease had passed to another."""
        return bool(self._release(keys=[self.key("flag", name), self.key("flag", name, "wake"),
                                        self.key("flags", "stats")], args=[token]))

    @_translated
    def flag_stats(self) -> dict[str, int]:
        """How many flags were granted, granted after a wait, and released after their lease expired."""
        raw = self._redis.hgetall(self.key("flags", "stats"))
        return {name: int(raw.get(name, 0)) for name in FLAG_STATS}

    @_translated
    def create_role_users(self, passwords: dict[str, str]) -> list[str]:
        """Create (or reset) the ACL user ``imerge-{role}`` of each role, allowed only its commands on this
        job's keys; needs an admin connection. Returns the user names."""
        users = []
        for role, password in passwords.items():
            if role not in ROLE_COMMANDS:
                raise StoreError(f"no ACL for role {role!r}; roles: {', '.join(ROLE_COMMANDS)}")
            user = f"imerge-{role}"
            self._redis.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}",
                                        f"~{self._prefix}*", "resetchannels", "-@all",
                                        *(f"+{command}" for command in ROLE_COMMANDS[role]))
            users.append(user)
        return users

    @_translated
    def registered_shards(self) -> int:
        return int(self._redis.hlen(self.key("shards")))

    # -- generations and recovery ------------------------------------------------
    @_translated
    def generation(self) -> int | None:
        """The job generation; None when the key is absent (no plan yet, or Redis lost the job's state)."""
        value = self._redis.get(self.key("generation"))
        return None if value is None else int(value)

    @_translated
    def start_generation(self, generation: int, payload: str) -> None:
        """Publish ``generation`` (the coordinator alone does): its event first, then the key."""
        self.set_event(f"generation:{generation}", payload)
        self._redis.set(self.key("generation"), str(generation))

    @_translated
    def shard_heartbeat(self, index: int, ttl_s: float, generation: int) -> None:
        self._redis.set(self.key("shard", index, "alive"), str(generation), px=int(ttl_s * 1000))

    @_translated
    def member_generations(self, num_workers: int, num_shards: int) -> dict[str, int]:
        """The generation each live member's heartbeat names ("worker 0", "shard 1", ...)."""
        members = [f"worker {r}" for r in range(num_workers)] + [f"shard {i}" for i in range(num_shards)]
        pipe = self._redis.pipeline()
        for member in members:
            pipe.get(self.key(*member.split(" "), "alive"))
        return {member: int(value) for member, value in zip(members, pipe.execute()) if value is not None}

    @_translated
    def publish_checkpoints(self, index: int, rounds: list[int]) -> None:
        self._redis.hset(self.key("checkpoints"), str(index), json.dumps(rounds))

    @_translated
    def checkpoint_rounds(self) -> dict[int, list[int]]:
        """Each shard's complete checkpoint rounds, as it last published them."""
        return {int(k): json.loads(v) for k, v in self._redis.hgetall(self.key("checkpoints")).items()}

    @_translated
    def report_failure(self, generation: int, who: str, reason: str) -> None:
        self._redis.rpush(self.key("failures", "queue"),
                          json.dumps({"generation": generation, "who": who, "reason": reason}))

    @_translated
    def pop_report(self, timeout_s: float) -> tuple[str, Any] | None:
        """One report, ("done", rank) or ("failure", {generation, who, reason}), or None within ``timeout_s``."""
        item = self._redis.blpop([self.key("failures", "queue"), self.key("done", "queue")],
                                 timeout=_slice(timeout_s))
        if item is None:
            return None
        if item[0] == self.key("done", "queue"):
            return "done", int(item[1])
        return "failure", json.loads(item[1])

    @_translated
    def record_worker(self, rank: int, generation: int, iteration: int) -> None:
        """The generation this worker joined and its data position (iterations done)."""
        pipe = self._redis.pipeline()
        pipe.set(self.key("worker", rank, "generation"), str(generation))
        pipe.hset(self.key("positions"), str(rank), json.dumps({"iteration": iteration,
                                                                 "generation": generation}))
        pipe.execute()

    @_translated
    def worker_generation(self, rank: int) -> int | None:
        value = self._redis.get(self.key("worker", rank, "generation"))
        return None if value is None else int(value)
