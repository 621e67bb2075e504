"""The control plane's store: the only module in IMerge that issues Redis commands.

Every role (coordinator, shards, workers) reaches Redis through :class:`Store`,
whose methods are named for what they mean and take and return the typed
messages of :mod:`imerge.control.messages`; no key or event name appears
outside this module.
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
``worker:{rank}:lease``     string   the rank lease (:class:`RankLeaseValue`: "host:pid:nonce beats"), renewed by the
                                     holder's heartbeat
                                     (the beat counts renewals), expires after the heartbeat TTL
``worker:{rank}:beats``     list     one token pushed by each renewal of the lease (wakes a claimant)
``worker:{rank}:alive``     string   heartbeat: the generation the worker serves (-1 while joining),
                                     expires after the heartbeat TTL
``layout:{rank}``           string   the worker's model layout (JSON, see planning)
``layouts:queue``           list     ranks, pushed when a layout is submitted
``event:{name}``            list     a latch: holds one token once the event is set
``event:{name}:value``      string   the event's payload
``done:queue``              list     ranks, pushed when a worker finished its job
``done``                    hash     rank -> 1 once the worker finished (read by a restarted coordinator)
``loading``                 string   the generation worker 0 imports an imerge.load's state into, while it does
                                     (a shard accepts an Import only then); expires
``profile``                 string   worker 0's profile for ``--fusion cost`` (JSON)
``profile:queue``           list     a token, pushed when the profile is submitted
``flag:{f}``                string   holder token of slot flag f (:class:`Flag`: ``{v}:{g}:{s}[:{lane}]``, plan
                                     v, group g or ``port``, shard s, lane when not 0), with the lease as its
                                     expiry; absent = free
``flag:{f}:wake``           list     one token pushed by each release, to wake a waiter
``flags:stats``             hash     granted / contended (granted after a wait) / expired
                                     (released after the lease had passed) flag counts
``generation``              string   the job generation (absent until the plan is published;
                                     its loss means Redis lost the job's state)
``finished``                string   when every worker had finished (epoch seconds): the job is over
``lease``                   string   JSON {token, holder}: the run that holds the job's name (:class:`JobLease`),
                                     renewed by its coordinator, expires after the coordinator's heartbeat TTL
``shard:{i}:alive``         string   a shard's heartbeat: the generation it serves; expires after its TTL
``checkpoints``             hash     shard index -> JSON list of its complete checkpoint rounds
``failures:queue``          list     JSON {generation, who, reason}: a process saw a peer fail
``worker:{rank}:generation`` string  the generation the worker last joined
``positions``               hash     worker rank -> JSON {iteration, generation}: data position
``buffers:{g}:{i}:{rank}``  string   the model buffers (:class:`ModuleState`) a worker published after iteration i
                                     of generation g (broadcast_buffers); expires
``buffers:{g}:{i}:{rank}:ready`` list  a latch: holds a token once those buffers are published; expires
``scalars:{g}:{r}:to:{s}``  list     :class:`PostedScalars` (shard, sum of squares, found inf): each shard's
                                     scalars of round r that shard s needs before it steps (clipping, loss
                                     scaling); expires
==========================  =======  ==============================================

Events in use: ``plan:{version}`` (:class:`PlanPublished`; version 1 is the
first plan, 2 the cost plan), ``blocks-ready:{version}`` (:class:`BlocksReady`:
rank 0 created every block of that plan; ``blocks-ready:1`` means the job is
running), ``generation:{g}`` (:class:`GenerationEvent`: recover from the
checkpoint of its round), ``restored:{g}:{shard}`` (:class:`Restored`) and
``loaded:{g}:{n}`` (:class:`Loaded`: worker 0 imported the n-th imerge.load).

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
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from imerge.core.config import redacted
from imerge.core.errors import GenerationChanged, JobTaken, StoreError, WaitTimeout

from .messages import (COST_PLAN, FIRST_PLAN, BlocksReady, CheckpointRounds, FailureReport, Flag, FlagGrant,
                       GenerationEvent, JobLease, LayoutSubmission, Loaded, Malformed, Member, ModuleState,
                       PlanPublished, PostedScalars, Profile, RankHolder, RankLeaseValue, Restored, RoundScalars,
                       WorkerDone, WorkerInfo, WorkerPosition)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_BLOCK_SLICE_S = 5.0
# The generation key is read by name (ARGV[5]), not declared: a key declared to a script must be writable by the
# caller's ACL user, and only the coordinator writes it. The fencing token is Redis' clock in microseconds:
# later grants get larger tokens, and no role holds a counter it could turn back.
_ACQUIRE = """
local generation = redis.call('GET', ARGV[5]) or '0'
if generation ~= ARGV[4] then return {-1, tonumber(generation)} end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('DEL', KEYS[2])
  redis.call('HINCRBY', KEYS[3], 'granted', 1)
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'contended', 1) end
  local now = redis.call('TIME')
  return {1, tonumber(now[1]) * 1000000 + tonumber(now[2])}
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
# What each role's Redis ACL user may do (Redis 7 key permissions): run its commands, read every key of its job,
# and write only the keys of its job that ROLE_WRITES lists (patterns under imerge:{job}:). Everything else is
# denied: no role can FLUSHALL, CONFIG, KEYS, DEBUG or touch another job; only the coordinator writes the plan,
# the generation and its events; only shards register addresses and checkpoint rounds. Lua scripts are checked
# command by command and key by key, and a key declared to a script must be writable by the caller.
_CONNECTION = ("ping", "select", "multi", "exec", "discard", "info")  # and client|setinfo where Redis has it (7.2)
ROLE_COMMANDS = {
    "coordinator": _CONNECTION + ("get", "set", "rpush", "blpop", "hgetall", "hlen", "exists", "scan", "unlink"),
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
               "profile:queue", "buffers:*", "flag:*", "flags:stats", "failures:queue", _LATCHES,
               "event:blocks-ready:*", "event:loaded:*"),
}
ACL_MIN_REDIS = (7, 0)  # %R~ (read-only) key permissions

# A rank lease: claim it if free (or held by ARGV[3], a holder known dead); else return the holder's lease
# and clear the beats list, so that a beat popped afterwards proves the holder renewed it since.
_CLAIM_RANK = """
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1] .. ' 0', 'PX', ARGV[2])
  return false
end
redis.call('DEL', KEYS[2])
return {current, redis.call('PTTL', KEYS[1])}
"""
_RENEW_RANK = """
local current = redis.call('GET', KEYS[1])
if current ~= false and string.sub(current, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 0 end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[3], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""
_RELEASE_RANK = """
local current = redis.call('GET', KEYS[1])
if current ~= false and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then redis.call('DEL', KEYS[1]) end
return 0
"""


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
        self._claim_rank = self._redis.register_script(_CLAIM_RANK)
        self._renew_rank = self._redis.register_script(_RENEW_RANK)
        self._release_rank = self._redis.register_script(_RELEASE_RANK)

    def _key(self, *parts: object) -> str:
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
    def publish_plan(self, version: int, message: PlanPublished) -> None:
        self._set_event(f"plan:{version}", message.encode())

    @_translated
    def wait_plan(self, version: int, timeout_s: float, what: str) -> PlanPublished:
        return PlanPublished.decode(self._wait_event(f"plan:{version}", timeout_s, what))

    @_translated
    def read_plan(self, version: int) -> PlanPublished | None:
        """The plan of ``version`` if it was published, without waiting."""
        payload = self._read_event(f"plan:{version}")
        return PlanPublished.decode(payload) if payload else None

    def latest_plan(self) -> PlanPublished | None:
        """The newest published plan (the cost plan once there is one), without waiting."""
        first = self.read_plan(FIRST_PLAN)
        if first is None or first.plan is None:
            return first
        return self.read_plan(COST_PLAN) or first

    @_translated
    def announce_blocks_ready(self, version: int, message: BlocksReady) -> None:
        self._set_event(f"blocks-ready:{version}", message.encode())

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
    def register_shard(self, index: int, address: str) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self._key("shards"), str(index), address)
        pipe.rpush(self._key("shards", "queue"), str(index))
        pipe.execute()

    @_translated
    def wait_shards(self, count: int, timeout_s: float) -> list[str]:
        """Addresses of shards 0..count-1, once all of them registered."""
        self._collect("shards", count, timeout_s, "PS shards {missing} to register")
        addresses = self._redis.hgetall(self._key("shards"))
        return [_text(addresses[str(i)]) for i in range(count)]

    @_translated
    def registered_shards(self) -> int:
        return int(self._redis.hlen(self._key("shards")))

    # -- workers ------------------------------------------------------------
    @_translated
    def claim_rank(self, rank: int, holder: RankHolder, ttl_s: float, replacing: RankLeaseValue | None = None
                   ) -> tuple[RankLeaseValue, int] | None:
        """Take rank ``rank``'s lease for ``holder`` if it is free (or it is ``replacing``: a holder known dead);
        else (the lease as it is, its remaining milliseconds)."""
        held = self._claim_rank(keys=[self._key("worker", rank, "lease"), self._key("worker", rank, "beats")],
                                args=[holder.token, int(ttl_s * 1000), replacing.encode() if replacing else "\x00"])
        return None if held is None else (RankLeaseValue.decode(_text(held[0])), int(held[1]))

    @_translated
    def wait_rank_renewed(self, rank: int, timeout_s: float) -> bool:
        """Block until the holder of rank ``rank`` renews its lease (True) or ``timeout_s`` passes (False)."""
        return self._redis.blpop([self._key("worker", rank, "beats")], timeout=_slice(timeout_s)) is not None

    @_translated
    def renew_rank(self, rank: int, holder: RankHolder, beat: int, ttl_s: float) -> bool:
        """Renew rank ``rank``'s lease if ``token`` holds it (or take it again if it expired unclaimed); False: it
        passed to another holder."""
        return bool(self._renew_rank(keys=[self._key("worker", rank, "lease"), self._key("worker", rank, "beats")],
                                     args=[holder.token, int(ttl_s * 1000), beat]))

    @_translated
    def release_rank(self, rank: int, holder: RankHolder) -> None:
        self._release_rank(keys=[self._key("worker", rank, "lease")], args=[holder.token])

    @_translated
    def register_worker(self, rank: int, info: WorkerInfo, ttl_s: float) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self._key("workers"), str(rank), info.encode())
        pipe.set(self._key("worker", rank, "alive"), "-1", px=int(ttl_s * 1000))
        pipe.execute()

    @_translated
    def heartbeat(self, rank: int, ttl_s: float, generation: int = -1) -> None:
        self._redis.set(self._key("worker", rank, "alive"), str(generation), px=int(ttl_s * 1000))

    @_translated
    def submit_layout(self, rank: int, submission: LayoutSubmission) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self._key("layout", rank), submission.encode())
        pipe.rpush(self._key("layouts", "queue"), str(rank))
        pipe.execute()

    @_translated
    def wait_layouts(self, world_size: int, timeout_s: float) -> dict[int, LayoutSubmission]:
        self._collect("layouts", world_size, timeout_s, "workers {missing} to submit their model layout")
        return self.layouts(world_size)

    @_translated
    def layouts(self, world_size: int) -> dict[int, LayoutSubmission]:
        """The submitted layouts, without waiting (for a coordinator that restarts mid-job)."""
        pipe = self._redis.pipeline()
        for rank in range(world_size):
            pipe.get(self._key("layout", rank))
        return {rank: LayoutSubmission.decode(text) for rank, text in enumerate(pipe.execute()) if text}

    @_translated
    def mark_done(self, rank: int) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self._key("done"), str(rank), "1")
        pipe.rpush(self._key("done", "queue"), str(rank))
        pipe.execute()

    @_translated
    def leave(self, rank: int) -> None:
        """A worker that finished and released its rank lease drops its liveness key: it has left the job."""
        self._redis.delete(self._key("worker", rank, "alive"))

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
    def record_worker(self, rank: int, position: WorkerPosition) -> None:
        """The generation this worker joined and its data position (iterations done)."""
        pipe = self._redis.pipeline()
        pipe.set(self._key("worker", rank, "generation"), str(position.generation))
        pipe.hset(self._key("positions"), str(rank), position.encode())
        pipe.execute()

    @_translated
    def worker_generation(self, rank: int) -> int | None:
        value = self._redis.get(self._key("worker", rank, "generation"))
        return None if value is None else int(value)

    # -- profile (fusion cost) ------------------------------------------------
    @_translated
    def submit_profile(self, profile: Profile) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self._key("profile"), profile.encode())
        pipe.rpush(self._key("profile", "queue"), "1")
        pipe.execute()

    @_translated
    def wait_profile(self, timeout_s: float) -> Profile:
        self._pop(self._key("profile", "queue"), time.monotonic() + timeout_s,
                  "worker 0's profile of its first iterations", timeout_s)
        return Profile.decode(_text(self._redis.get(self._key("profile")) or ""))

    # -- imerge.load ------------------------------------------------------------
    @_translated
    def announce_loading(self, generation: int, ttl_s: float) -> None:
        """Worker 0 is about to import an imerge.load's state into the shards of ``generation``: until
        :meth:`end_loading` (or ``ttl_s``), a shard accepts an Import of that generation (:meth:`loading`)."""
        self._redis.set(self._key("loading"), str(generation), px=max(int(ttl_s * 1000), 1))

    @_translated
    def end_loading(self) -> None:
        self._redis.delete(self._key("loading"))

    @_translated
    def loading(self, generation: int) -> bool:
        """Whether worker 0 announced an import of ``generation`` and has not ended it."""
        return self._redis.get(self._key("loading")) == str(generation)

    @_translated
    def announce_loaded(self, generation: int, sequence: int, message: Loaded) -> None:
        """Worker 0 imported the ``sequence``-th imerge.load of ``generation`` into the shards (or failed)."""
        self._set_event(f"loaded:{generation}:{sequence}", message.encode())

    @_translated
    def wait_loaded(self, generation: int, sequence: int, timeout_s: float) -> Loaded:
        return Loaded.decode(self._wait_event(f"loaded:{generation}:{sequence}", timeout_s,
                                              f"worker 0 to load the saved state (imerge.load #{sequence})"))

    # -- model buffers (broadcast_buffers) --------------------------------------
    @_translated
    def publish_buffers(self, generation: int, iteration: int, rank: int, state: ModuleState, ttl_s: float) -> None:
        key, ttl_ms = self._key("buffers", generation, iteration, rank), int(ttl_s * 1000)
        pipe = self._redis.pipeline()
        pipe.set(key, state.encode(), px=ttl_ms)
        pipe.rpush(key + ":ready", "1")
        pipe.pexpire(key + ":ready", ttl_ms)
        pipe.execute()

    @_translated
    def wait_buffers(self, generation: int, iteration: int, rank: int, timeout_s: float) -> ModuleState:
        """The buffers worker ``rank`` published after ``iteration`` (waits for them; the latch stays set)."""
        key = self._key("buffers", generation, iteration, rank)
        self._pop(key + ":ready", time.monotonic() + timeout_s,
                  f"worker {rank}'s model buffers of iteration {iteration}", timeout_s)
        pipe = self._redis.pipeline()
        pipe.rpush(key + ":ready", "1")
        pipe.pexpire(key + ":ready", max(int(self._redis.pttl(key)), 1000))
        pipe.get(key)
        published = pipe.execute()[-1]
        return ModuleState.decode(_text(published)) if published else ModuleState()

    # -- round scalars (the shards agree before they step) ---------------------------------
    @_translated
    def post_round_scalars(self, generation: int, round_: int, posted: PostedScalars, to_shards: list[int],
                           ttl_s: float) -> None:
        pipe = self._redis.pipeline()
        for target in to_shards:
            key = self._key("scalars", generation, round_, "to", target)
            pipe.rpush(key, posted.encode())
            pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    @_translated
    def wait_round_scalars(self, generation: int, round_: int, shard: int, shards: list[int],
                           timeout_s: float) -> dict[int, RoundScalars]:
        """Every shard's scalars of ``round_`` (by shard), as they post them to ``shard``."""
        deadline, received = time.monotonic() + timeout_s, dict[int, RoundScalars]()
        while len(received) < len(shards):
            missing = sorted(set(shards) - set(received))
            posted = PostedScalars.decode(self._pop(self._key("scalars", generation, round_, "to", shard), deadline,
                                                    f"shards {missing} to post their scalars of round {round_}",
                                                    timeout_s))
            received[posted.shard] = posted.scalars
        return received

    # -- slot flags -------------------------------------------------------------
    @_translated
    def clock_us(self) -> int:
        """Redis' clock in microseconds: what the slot flags' fencing tokens are issued from."""
        seconds, microseconds = self._redis.time()
        return int(seconds) * 1_000_000 + int(microseconds)

    @_translated
    def acquire_flag(self, flag: Flag, token: str, lease_s: float, timeout_s: float,
                     generation: int = 0) -> FlagGrant:
        """Take slot flag ``flag`` for ``token`` in ``generation``; block (no polling) while another holds it.

        WaitTimeout names the holder; GenerationChanged says the job moved on.
        """
        holder, wake = self._key("flag", flag), self._key("flag", flag, "wake")
        deadline = time.monotonic() + timeout_s
        contended = False
        while True:
            outcome, value = self._acquire(keys=[holder, wake, self._key("flags", "stats")],
                                           args=[token, int(lease_s * 1000), int(contended), generation,
                                                 self._key("generation")])
            if outcome == -1:
                raise GenerationChanged(f"slot flag {flag}: the job is at generation {value}, not {generation}",
                                        value)
            if outcome == 1:
                return FlagGrant(contended, value)
            remaining_lease_ms = value
            contended = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for slot flag {flag} "
                                  f"(held by {self._redis.get(holder)!s})")
            wait = min(remaining, max(remaining_lease_ms, 10) / 1000, _BLOCK_SLICE_S)
            self._redis.blpop([wake], timeout=_slice(wait))

    @_translated
    def release_flag(self, flag: Flag, token: str) -> bool:
        """Free slot flag ``flag`` if ``token`` still holds it; False if its lease had passed to another."""
        return bool(self._release(keys=[self._key("flag", flag), self._key("flag", flag, "wake"),
                                        self._key("flags", "stats")], args=[token]))

    @_translated
    def flag_stats(self) -> dict[str, int]:
        """How many flags were granted, granted after a wait, and released after their lease expired."""
        raw = self._redis.hgetall(self._key("flags", "stats"))
        return {name: int(raw.get(name, 0)) for name in FLAG_STATS}

    @_translated
    def create_role_users(self, passwords: dict[str, str]) -> list[str]:
        """Create (or reset) the ACL user ``imerge-{role}`` of each role, allowed only its commands on this
        job's keys; needs an admin connection. Returns the user names."""
        version = str(self._redis.info("server").get("redis_version", "0"))
        major_minor = tuple(int(part) for part in version.split(".")[:2])
        if major_minor < ACL_MIN_REDIS:
            raise StoreError(f"per-role ACL users need Redis {'.'.join(map(str, ACL_MIN_REDIS))} or newer (read-only "
                             f"key permissions); this server runs Redis {version}")
        users = []
        for role, password in passwords.items():
            if role not in ROLE_COMMANDS:
                raise StoreError(f"no ACL for role {role!r}; roles: {', '.join(ROLE_COMMANDS)}")
            user = f"imerge-{role}"
            keys = [f"%R~{self._prefix}*"] + [f"~{self._prefix}{pattern}" for pattern in ROLE_WRITES[role]]
            commands = ROLE_COMMANDS[role] + (("client|setinfo",) if major_minor >= (7, 2) else ())
            acl = ["ACL", "SETUSER", user, "reset", "on", f">{password}", *keys, "resetchannels", "-@all",
                   *(f"+{command}" for command in commands)]
            self._redis.execute_command(*acl)  # type: ignore[no-untyped-call]
            users.append(user)
        return users

    # -- which run holds the job's name ---------------------------------------------------
    @_translated
    def claim_job(self, lease: JobLease, ttl_s: float) -> JobLease | None:
        """Take (or renew) the job's lease for ``lease.token``; the other run's lease where another token holds
        it."""
        key, ttl_ms = self._key("lease"), int(ttl_s * 1000)
        if self._redis.set(key, lease.encode(), nx=True, px=ttl_ms):
            return None
        held = self.job_lease()
        if held is not None and held.token != lease.token:
            return held
        self._redis.set(key, lease.encode(), px=ttl_ms)
        return None

    @_translated
    def job_lease(self) -> JobLease | None:
        text = self._redis.get(self._key("lease"))
        return JobLease.decode(_text(text)) if text else None

    def check_job(self, token: str, what: str) -> None:
        """JobTaken where another run's token holds the job's name (``token`` empty: nothing to tell apart)."""
        held = self.job_lease() if token else None
        if held is not None and held.token != token:
            raise JobTaken(held.refusal(self.job, what))

    @_translated
    def release_job(self, token: str) -> None:
        held = self.job_lease()
        if held is not None and held.token == token:
            self._redis.unlink(self._key("lease"))

    # -- the job's end, and a fresh start -------------------------------------------
    @_translated
    def mark_finished(self) -> None:
        """Every worker finished: the job is over (a coordinator started again under its name refuses it)."""
        self._redis.set(self._key("finished"), str(time.time()))

    @_translated
    def finished_at(self) -> float | None:
        """When the job finished (epoch seconds), or None."""
        value = self._redis.get(self._key("finished"))
        return None if value is None else float(value)

    @_translated
    def clear_job(self) -> int:
        """Delete every key of the job (to start its name afresh); the number deleted."""
        deleted = 0
        batch: list[str] = []
        for key in self._redis.scan_iter(match=self._prefix + "*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                deleted += self._redis.unlink(*batch)
                batch = []
        return deleted + (self._redis.unlink(*batch) if batch else 0)

    # -- generations and recovery ------------------------------------------------
    @_translated
    def generation(self) -> int | None:
        """The job generation; None when the key is absent (no plan yet, or Redis lost the job's state)."""
        value = self._redis.get(self._key("generation"))
        return None if value is None else int(value)

    @_translated
    def start_generation(self, event: GenerationEvent) -> None:
        """Publish a generation (the coordinator alone does): its event first, then the key."""
        self._set_event(f"generation:{event.generation}", event.encode())
        self._redis.set(self._key("generation"), str(event.generation))

    @_translated
    def generation_event(self, generation: int) -> GenerationEvent | None:
        """The event that started ``generation``, if it was published."""
        payload = self._read_event(f"generation:{generation}")
        return GenerationEvent.decode(payload) if payload else None

    @_translated
    def wait_generation(self, generation: int, timeout_s: float, what: str) -> GenerationEvent:
        return GenerationEvent.decode(self._wait_event(f"generation:{generation}", timeout_s, what))

    @_translated
    def announce_restored(self, message: Restored) -> None:
        self._set_event(f"restored:{message.generation}:{message.shard}", message.encode())

    @_translated
    def wait_restored(self, generation: int, shard: int, timeout_s: float) -> Restored:
        return Restored.decode(self._wait_event(f"restored:{generation}:{shard}", timeout_s,
                                                f"shard {shard} to restore generation {generation}"))

    @_translated
    def shard_heartbeat(self, index: int, ttl_s: float, generation: int) -> None:
        self._redis.set(self._key("shard", index, "alive"), str(generation), px=int(ttl_s * 1000))

    @_translated
    def member_generations(self, num_workers: int, num_shards: int) -> dict[Member, int]:
        """The generation each live member's heartbeat names."""
        members = [Member.worker(r) for r in range(num_workers)] + [Member.shard(i) for i in range(num_shards)]
        pipe = self._redis.pipeline()
        for member in members:
            pipe.get(self._key(member.kind, member.index, "alive"))
        return {member: int(value) for member, value in zip(members, pipe.execute()) if value is not None}

    @_translated
    def publish_checkpoints(self, index: int, rounds: list[int]) -> None:
        self._redis.hset(self._key("checkpoints"), str(index), CheckpointRounds(rounds).encode())

    @_translated
    def checkpoint_rounds(self) -> dict[int, list[int]]:
        """Each shard's complete checkpoint rounds, as it last published them."""
        return {int(k): CheckpointRounds.decode(_text(v)).rounds
                for k, v in self._redis.hgetall(self._key("checkpoints")).items()}

    @_translated
    def report_failure(self, report: FailureReport) -> None:
        self._redis.rpush(self._key("failures", "queue"), report.encode())

    @_translated
    def pop_report(self, timeout_s: float) -> WorkerDone | FailureReport | Malformed | None:
        """The next report (a worker finished, or a process saw a failure), or None within ``timeout_s``; one
        that does not decode comes back as :class:`Malformed` (a worker's Redis user may write these queues)."""
        item = self._redis.blpop([self._key("failures", "queue"), self._key("done", "queue")],
                                 timeout=_slice(timeout_s))
        if item is None:
            return None
        done = item[0] == self._key("done", "queue")
        try:
            return WorkerDone.decode(_text(item[1])) if done else FailureReport.decode(_text(item[1]))
        except StoreError as exc:
            return Malformed("done" if done else "failures", str(exc))
