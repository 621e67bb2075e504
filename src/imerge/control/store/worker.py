"""The worker's facet of the store: its rank lease and heartbeat, its layout and profile, imerge.load, the
model buffers, the slot flags, and its done mark."""
from __future__ import annotations

import time

from imerge.core.errors import GenerationChanged, WaitTimeout

from ..messages import (BlocksReady, Flag, FlagGrant, LayoutSubmission, Loaded, ModuleState, PlanPublished, Profile,
                        RankHolder, RankLeaseValue, Window, WorkerInfo, WorkerPosition)
from .base import _BLOCK_SLICE_S, StoreBase, _slice, _text, _translated

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




class WorkerStore(StoreBase):
    """What worker writes (ROLE_WRITES["worker"]), besides what every role may read."""

    def __init__(self, url: str, job: str, *, socket_timeout_s: float = 10.0):
        super().__init__(url, job, socket_timeout_s=socket_timeout_s)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._claim_rank = self._redis.register_script(_CLAIM_RANK)
        self._renew_rank = self._redis.register_script(_RENEW_RANK)
        self._release_rank = self._redis.register_script(_RELEASE_RANK)

    # -- the plan ---------------------------------------------------------------
    @_translated
    def announce_blocks_ready(self, version: int, message: BlocksReady) -> None:
        self._set_event(f"blocks-ready:{version}", message.encode())

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
    def record_worker(self, rank: int, position: WorkerPosition) -> None:
        """The generation this worker joined and its data position (iterations done)."""
        pipe = self._redis.pipeline()
        pipe.set(self._key("worker", rank, "generation"), str(position.generation))
        pipe.hset(self._key("positions"), str(rank), position.encode())
        pipe.execute()

    # -- profile (fusion cost) ------------------------------------------------
    @_translated
    def submit_profile(self, profile: Profile) -> None:
        pipe = self._redis.pipeline()
        pipe.set(self._key("profile"), profile.encode())
        pipe.rpush(self._key("profile", "queue"), "1")
        pipe.execute()

    @_translated
    def wait_switch_plan(self, version: int, generation: int, timeout_s: float, what: str) -> PlanPublished:
        """Plan ``version`` once published; GenerationChanged as soon as the job left ``generation`` (a failure
        during the profile: the plan will not come in this generation), JobFailed where it cannot recover."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return PlanPublished.decode(self._wait_event(f"plan:{version}", min(1.0, timeout_s), what))
            except WaitTimeout:
                current = self.generation()
                if current is not None and current != generation:
                    event = self.generation_event(current)
                    if event is not None:
                        event.check()
                    raise GenerationChanged(f"the job moved to generation {current} while this worker waited for "
                                            f"{what}", current) from None
                if time.monotonic() >= deadline:
                    raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}") from None

    # -- online re-tuning ------------------------------------------------------
    @_translated
    def submit_window(self, window: Window) -> None:
        self._redis.rpush(self._key("windows", "queue"), window.encode())

    @_translated
    def poll_plans(self, rank: int, iteration: int) -> int:
        """Record that this worker looked at the plans at ``iteration`` and return the newest version, in one
        transaction: a re-tuned plan is published only before every worker's poll at the boundary ahead of its
        switch (see the coordinator's publish_switch)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._key("worker", rank, "polled"), str(iteration))
        pipe.get(self._key("plan", "latest"))
        return int(pipe.execute()[1] or 0)

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
    def announce_loaded(self, generation: int, sequence: int, message: Loaded) -> None:
        """Worker 0 imported the ``sequence``-th imerge.load of ``generation`` into the shards (or failed)."""
        self._set_event(f"loaded:{generation}:{sequence}", message.encode())

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

    # -- slot flags -------------------------------------------------------------
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
