"""The coordinator's facet of the store: the plan, the generations, the job's name and end, the reports it takes,
and the ACL users of the roles."""
from __future__ import annotations

import time

from imerge.core.errors import StoreError

from ..messages import (FailureReport, GenerationEvent, JobLease, LayoutSubmission, Malformed, PlanPublished,
                        Profile, Window, WorkerDone)
from .base import ACL_MIN_REDIS, ROLE_COMMANDS, ROLE_WRITES, StoreBase, _slice, _text, _translated


# A re-tuned plan is published only where no worker has polled the plans at or past ARGV[3] (the last window
# boundary before its switch): each worker then reads it at that boundary at the latest, as its poll (one MULTI)
# comes after this script. Else the furthest boundary polled comes back, and nothing is written.
_PUBLISH_SWITCH = """
for i = 4, #KEYS do
  local polled = tonumber(redis.call('GET', KEYS[i]) or '-1')
  if polled >= tonumber(ARGV[3]) then return polled end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], '1')
redis.call('SET', KEYS[3], ARGV[2])
return -1
"""


class CoordinatorStore(StoreBase):
    """What coordinator writes (ROLE_WRITES["coordinator"]), besides what every role may read."""

    def __init__(self, url: str, job: str, *, socket_timeout_s: float = 10.0):
        super().__init__(url, job, socket_timeout_s=socket_timeout_s)
        self._publish_switch = self._redis.register_script(_PUBLISH_SWITCH)

    # -- the plan ---------------------------------------------------------------
    @_translated
    def publish_plan(self, version: int, message: PlanPublished) -> None:
        self._set_event(f"plan:{version}", message.encode())
        self._redis.set(self._key("plan", "latest"), str(version))

    @_translated
    def publish_switch(self, message: PlanPublished, workers: int, unpolled_from: int) -> int:
        """Publish a re-tuned plan (its version and switch iteration in ``message``) unless one of the ``workers``
        polled the plans at iteration ``unpolled_from`` or later; -1 where published, else that furthest
        iteration polled (choose a later switch and try again)."""
        assert message.plan is not None
        version = message.plan.version
        keys = [self._key("event", f"plan:{version}", "value"), self._key("event", f"plan:{version}"),
                self._key("plan", "latest"), *(self._key("worker", rank, "polled") for rank in range(workers))]
        return int(self._publish_switch(keys=keys, args=[message.encode(), str(version), str(unpolled_from)]))

    # -- shards -------------------------------------------------------------
    @_translated
    def wait_shards(self, count: int, timeout_s: float) -> list[str]:
        """Addresses of shards 0..count-1, once all of them registered."""
        self._collect("shards", count, timeout_s, "PS shards {missing} to register")
        addresses = self._redis.hgetall(self._key("shards"))
        return [_text(addresses[str(i)]) for i in range(count)]

    # -- workers ------------------------------------------------------------
    @_translated
    def wait_layouts(self, world_size: int, timeout_s: float) -> dict[int, LayoutSubmission]:
        self._collect("layouts", world_size, timeout_s, "workers {missing} to submit their model layout")
        return self.layouts(world_size)

    # -- profile (fusion cost) ------------------------------------------------
    @_translated
    def wait_profile(self, timeout_s: float) -> Profile:
        self._pop(self._key("profile", "queue"), time.monotonic() + timeout_s,
                  "worker 0's profile of its first iterations", timeout_s)
        return Profile.decode(_text(self._redis.get(self._key("profile")) or ""))

    # -- slot flags -------------------------------------------------------------
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
    def start_generation(self, event: GenerationEvent) -> None:
        """Publish a generation (the coordinator alone does): its event first, then the key."""
        self._set_event(f"generation:{event.generation}", event.encode())
        self._redis.set(self._key("generation"), str(event.generation))

    @_translated
    def pop_report(self, timeout_s: float) -> WorkerDone | FailureReport | Window | Malformed | None:
        """The next report (a worker finished, a process saw a failure, worker 0 measured a window), or None
        within ``timeout_s``; one
        that does not decode comes back as :class:`Malformed` (a worker's Redis user may write these queues)."""
        queues = {self._key(name, "queue"): name for name in ("failures", "done", "windows")}
        item = self._redis.blpop(list(queues), timeout=_slice(timeout_s))
        if item is None:
            return None
        queue = queues[_text(item[0])]
        kind = {"failures": FailureReport, "done": WorkerDone, "windows": Window}[queue]
        try:
            return kind.decode(_text(item[1]))  # type: ignore[attr-defined,no-any-return]
        except StoreError as exc:
            return Malformed(queue, str(exc))
