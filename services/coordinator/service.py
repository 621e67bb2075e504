"""The coordinator role: waits for shards and layouts, publishes the plan, watches membership.

After the plan it starts generation 0 and watches: workers that finish,
failures that processes report, heartbeats of workers and shards, and the
job's keys in Redis. A failure starts the next generation from the newest
checkpoint every shard holds (see :mod:`recovery`); a failure it cannot
recover from, or Redis losing the job's state, ends the job with the reason.
A coordinator that starts while its job is running (it was restarted) takes
the plan, the generation and the finished workers from Redis and watches on.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid

from imerge.control.messages import (FailureReport, GenerationEvent, JobLease, LayoutSubmission, Malformed, Member,
                                     PlanPublished, Profile, Window, WorkerDone)
from imerge.control.store import CoordinatorStore
from imerge.core.config import CommonConfig, option, require
from imerge.core.errors import (IMergeError, JobFailed, JobTaken, LayoutMismatchError, PlanError, StoreError,
                                WaitTimeout)
from imerge.core.planning import COST_PLAN, FIRST_PLAN, Layout, Plan, PlanOptions, make_plan
from imerge.core.schedule_config import ScheduleConfig
from imerge.sim.cluster import Constants
from imerge.sim.jobtune import JobDecision, decided_plan
from imerge.telemetry.metrics import MetricsServer

from .metrics import coordinator_registry
from .recovery import RecoveryImpossible, RecoveryPolicy
from .retuning import RetuneContext, Retuner, decide_logged

log = logging.getLogger(__name__)
REDIS_STALL_S = 1.0  # a Redis call this much slower than asked means Redis stalled: heartbeats are no evidence
MEMBERS_EVERY_S = 0.5  # the members' heartbeats and the job's keys are checked this often
REPORT_WAIT_S = 0.2  # one wait for a report: how soon a stop is seen (a report ends the wait at once)


class JobFinished(JobFailed):
    """A coordinator started under the name of a job that finished in the same Redis."""


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig(CommonConfig):
    num_workers: int = option(1, "number of workers in the job")
    num_shards: int = option(1, "number of PS shards in the job")
    heartbeat_ttl_s: float = option(10.0, "a worker whose heartbeat is older than this is lost")
    recover: bool = option(True, "recover from a lost worker or shard by restarting the job's generation "
                                 "from the last checkpoint every shard holds (off: fail with the reason)")
    max_recoveries: int = option(10, "recoveries after which a further failure ends the job")
    fresh: bool = option(False, "start the job afresh even if a run of the same --job finished (or failed) in "
                                "this Redis: delete its keys first (start the coordinator before the other roles)")
    link_gbit: float = option(0.0, "--tune: the link rate of the workers and shards the schedule is chosen for, "
                                   "Gbit/s (0: the rate worker 0's pushes measured)")
    queue_kb: float = option(0.0, "--tune: the queue of the switch port in front of a shard, kB, where known: slot "
                                  "flags are tried against it (0: unknown; no flags are tried)")
    calibration: str = option("", "--tune: the network model's constants (a JSON file of imerge simulate "
                                  "calibrate; default: real hosts, each with its own cores)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_workers >= 1, "num_workers", "must be at least 1")
        require(self.num_shards >= 1, "num_shards", "must be at least 1")
        require(self.heartbeat_ttl_s > 0, "heartbeat_ttl_s", "must be positive")
        require(self.max_recoveries >= 0, "max_recoveries", "must be >= 0")
        require(self.link_gbit >= 0, "link_gbit", "must be >= 0 (0: measured)")
        require(self.queue_kb >= 0, "queue_kb", "must be >= 0 (0: unknown)")
        if self.calibration:
            Constants.read(self.calibration)  # a ConfigError naming --calibration now, not at the plan switch


OPTION_FLAGS = {  # where a plan option comes from, when its flag's name is not its own
    "partition_bytes": " (--partition-mib; where it is 0, the workers' --link-mbps)",
    "size_cap_bytes": " (--size-cap-mib)", "first_cap_bytes": " (--first-cap-mib)",
    "period": " (--interleave-period)"}


def check_layouts(submissions: dict[int, LayoutSubmission]) -> tuple[Layout, PlanOptions]:
    """The agreed layout and scheduling options, or LayoutMismatchError naming the first difference."""
    reference = submissions[0]
    options = dataclasses.asdict(reference.options)
    for rank in sorted(submissions)[1:]:
        reference.layout.check_same(submissions[rank].layout, 0, rank)
        theirs = dataclasses.asdict(submissions[rank].options)
        for name, value in options.items():
            if theirs[name] != value:
                raise LayoutMismatchError(f"worker {rank} disagrees with worker 0 on option {name}: "
                                          f"{theirs[name]!r} vs {value!r}{OPTION_FLAGS.get(name, '')}")
    return reference.layout, reference.options


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: CoordinatorStore | None = None):
        self.config = config
        self.store = store or CoordinatorStore(config.redis_url, config.job)
        self._stop = threading.Event()
        self.plan: Plan | None = None  # the latest published plan
        self.retuner: Retuner | None = None  # online re-tuning, once --tune decided (with --retune-window)
        self.recovery = RecoveryPolicy(config.num_shards, config.recover, config.max_recoveries)
        self._alive: set[Member] = set()  # members seen alive in the current generation
        self._claimed: set[int] = set()  # workers reported done (counted done once they left the job)
        self._done: set[int] = set()  # workers done: reported done and left the job
        self._claimed_at: dict[int, float] = {}
        self._doubted: set[int] = set()  # reported done long ago, still in the job (logged once)
        self._redis_back_at = float("-inf")  # when Redis answered again after it was unreachable or stalled
        self._store_failing_since: float | None = None
        self._members_checked_at = float("-inf")
        self.token = uuid.uuid4().hex  # the job's lease token where no --job-token is given

    def stop(self) -> None:
        self._stop.set()

    def publish_plan(self) -> Plan:
        cfg = self.config
        addresses = self.store.wait_shards(cfg.num_shards, cfg.wait_timeout_s)
        log.info("all %d shards registered: %s", cfg.num_shards, ", ".join(addresses))
        layouts = self.store.wait_layouts(cfg.num_workers, cfg.wait_timeout_s)
        try:
            layout, options = check_layouts(layouts)
            plan = make_plan(layout, cfg.num_workers, addresses, version=FIRST_PLAN, options=options)
        except (LayoutMismatchError, PlanError) as exc:
            self.store.publish_plan(FIRST_PLAN, PlanPublished(error=str(exc), layout_mismatch=isinstance(
                exc, LayoutMismatchError)))
            raise
        self.recovery.period = plan.period  # generation 0 (with this run's id) goes first: shards read it with the plan
        self.store.start_generation(GenerationEvent(0, round=0, reason="start", run=uuid.uuid4().hex))
        self._publish(plan)
        if options.switches:
            plan = self.publish_cost_plan(layout, options, plan, layouts[0].schedule)
        return plan

    def _publish(self, plan: Plan) -> None:
        self.store.publish_plan(plan.version, PlanPublished(plan))
        self.plan = plan
        log.info("published plan v%d: %d groups, %d blocks, bytes per shard and phase %s",
                 plan.version, len(plan.groups), len(plan.blocks), plan.shard_load())

    def publish_cost_plan(self, layout: Layout, options: PlanOptions, first: Plan,
                          base: ScheduleConfig | None) -> Plan:
        """The second plan, from worker 0's profile: the blocks of ``first`` regrouped (fusion cost) and, with
        --tune, the knobs the simulated candidates chose (``base``: worker 0's schedule, their starting point)."""
        profile = self._await_profile()
        if profile is None:
            log.info("every worker finished before worker 0's profile: the job kept plan v%d", first.version)
            return first
        decision = None
        if options.tuned_knobs:
            decision = self._decide(profile, first, options, base or ScheduleConfig())
        plan = decided_plan(layout, options, first, profile, decision.knobs if decision else {},
                            decision.plan_fields() if decision else {}, COST_PLAN)
        if ((decision.fusion if decision else "") or options.fusion) == "cost":
            log.info("cost plan from alpha %.2e s, beta %.2e s/B: %d units in %d groups", profile.alpha_s,
                     profile.beta_s_per_byte, len(profile.unit_bytes), len(plan.groups))
        self._publish(plan)
        if decision is not None and options.retune_window:
            context = RetuneContext(layout, options, first, base or ScheduleConfig(), profile)
            self.retuner = Retuner(self.config, self.store, context, plan)
        return plan

    def _decide(self, profile: Profile, first: Plan, options: PlanOptions, base: ScheduleConfig
                ) -> JobDecision | None:
        return decide_logged(self.config, profile, first, options, base, link_gbit=self.config.link_gbit)

    def _await_profile(self) -> Profile | None:
        """Worker 0's profile (--fusion cost, --tune), watching the job meanwhile: a failure during the profiled
        iterations is recovered from like any other, and the workers profile again from the restored round. None
        where every worker finished first (a job shorter than its profile)."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        generation = self.recovery.generation
        while not self._stop.is_set():
            try:  # briefly: the reports (a failure) are taken in _step, which waits up to REPORT_WAIT_S for one
                return self.store.wait_profile(0.1)
            except WaitTimeout:
                if self.recovery.generation != generation:  # profiling starts over in the new generation
                    generation, deadline = self.recovery.generation, time.monotonic() + self.config.wait_timeout_s
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"timed out after {self.config.wait_timeout_s:g}s waiting for worker 0's "
                                      f"profile of its first iterations (generation {generation})") from None
            self._step(self._done)
            if len(self._done) >= self.config.num_workers:
                return None
        raise WaitTimeout("stopped while waiting for worker 0's profile")

    def watch(self) -> None:
        """Until every worker is done: take reports, check heartbeats and Redis, recover from failures.

        A worker's done mark is a claim (any worker's Redis user may write one): the worker counts as done once it
        has also left the job, its rank lease and liveness key gone. Until then it is watched like any member, so
        a forged mark neither ends the job early nor hides a later failure."""
        self._claimed |= self.store.done_ranks()
        while len(self._done) < self.config.num_workers and not self._stop.is_set():
            self._step(self._done)
        if len(self._done) >= self.config.num_workers:
            self.store.mark_finished()

    def _confirm_done(self, done: set[int]) -> None:
        """Count the workers that claimed done and have left the job."""
        pending = self._claimed - done
        if not pending:
            return
        for rank in sorted(self.store.departed(pending)):
            done.add(rank)
            log.info("worker %d finished (%d/%d)", rank, len(done), self.config.num_workers)
        for rank in sorted(pending - done - self._doubted):
            if time.monotonic() - self._claimed_at.get(rank, time.monotonic()) > self.config.heartbeat_ttl_s:
                self._doubted.add(rank)
                log.warning("worker %d was reported done but still holds its rank and heartbeats: the report is not "
                            "trusted until it leaves (it is watched as a member meanwhile)", rank)

    def _step(self, done: set[int]) -> None:
        """Take one report (a worker finished, or a failure to recover from) or check the members' heartbeats;
        Redis down or restarting is waited for, up to the wait timeout."""
        cfg = self.config
        try:
            asked = time.monotonic()
            report = self.store.pop_report(REPORT_WAIT_S)
            if self._store_failing_since is not None or time.monotonic() - asked > REPORT_WAIT_S + REDIS_STALL_S:
                self._redis_back_at = time.monotonic()  # Redis was away: heartbeats lapsed through no fault
            self._store_failing_since = None
            if isinstance(report, Malformed):
                log.warning("a report in the %s queue was ignored: %s", report.queue, report.why)
            elif isinstance(report, WorkerDone) and not 0 <= report.rank < cfg.num_workers:
                log.warning("a report that worker %d finished was ignored: the job has workers 0..%d",
                            report.rank, cfg.num_workers - 1)
            elif isinstance(report, WorkerDone):
                self._claimed.add(report.rank)
                self._claimed_at.setdefault(report.rank, time.monotonic())
                self._confirm_done(done)
            elif isinstance(report, Window):
                self._take_window(report)
            elif report is not None:
                self.handle_failure(report)
            due = time.monotonic() - self._members_checked_at >= MEMBERS_EVERY_S
            if (report is None or isinstance(report, Window)) and due:
                # every MEMBERS_EVERY_S, whatever the waits for reports; worker 0's windows, however fast they come,
                # must not starve the checks; a window is taken only when no failure or done report waits
                # (pop_report's order), so checking after one is as safe as after none (a worker that left is
                # counted done only once its done report is taken)
                self._members_checked_at = time.monotonic()
                self._confirm_done(done)
                self._check_members(done)
        except StoreError as exc:
            self._store_failing_since = self._store_failing_since or time.monotonic()
            if time.monotonic() - self._store_failing_since > cfg.wait_timeout_s:
                raise
            log.warning("%s; retrying", exc)
            self._stop.wait(0.5)

    def _take_window(self, window: Window) -> None:
        """Worker 0's window: online re-tuning may decide again and publish the next plan."""
        if self.retuner is None:
            log.debug("a window report was ignored: this job does not re-tune")
        elif window.generation == self.recovery.generation:
            self.retuner.submit(window, self._retuned)

    def _retuned(self, plan: Plan) -> None:
        """A plan re-tuning published (on its thread): the one the metrics and a recovery go by."""
        self.plan = plan

    def _check_members(self, done: set[int]) -> None:
        cfg = self.config
        if self.store.generation() is None:
            raise RecoveryImpossible("Redis lost the job's state: the plan and generation keys are gone (was it "
                                     "restarted without persistence? use appendonly yes); the job cannot continue")
        current = self.recovery.generation
        asked = time.monotonic()
        generations = self.store.member_generations(cfg.num_workers, cfg.num_shards)
        if time.monotonic() - asked > REDIS_STALL_S:  # Redis stalled (frozen, swapping): no evidence either way
            self._redis_back_at = time.monotonic()
            return
        live = {member for member, generation in generations.items() if generation == current}
        members = {Member.worker(r) for r in range(cfg.num_workers) if r not in done}
        members |= {Member.shard(i) for i in range(cfg.num_shards)}
        if time.monotonic() - self._redis_back_at < cfg.heartbeat_ttl_s:
            # Redis was unreachable or stalled within the last TTL: a lapsed heartbeat proves nothing until every
            # member had a whole TTL to renew it
            self._alive |= live
            return
        # A member lost once it was alive in this generation is a new failure; one not back in this generation
        # since the last recovery is still restarting (the others wait for it, up to their timeouts). A worker that
        # claimed done and is gone has left: the next step counts it done.
        members -= {Member.worker(r) for r in self._claimed}
        for member in sorted((self._alive & members) - live):
            self._alive.discard(member)
            self.handle_failure(FailureReport(self.recovery.generation, str(member), "its heartbeat expired (dead, "
                                                                                      "frozen or partitioned)"))
        if self.recovery.generation == current:
            self._alive |= live

    def handle_failure(self, failure: FailureReport) -> None:
        """Start the next generation for ``failure``, or publish why the job cannot recover and raise."""
        try:
            step = self.recovery.next_generation(failure, self.store.checkpoint_rounds())
        except RecoveryImpossible as exc:
            self.store.start_generation(GenerationEvent(self.recovery.generation + 1, error=str(exc)))
            raise
        if step is None:
            log.info("report of generation %d ignored (the job is at %d): %s", failure.generation,
                     self.recovery.generation, failure)
            return
        generation, round_ = step
        self._alive.clear()
        log.error("%s in generation %d: starting generation %d from the checkpoint of round %d",
                  failure, failure.generation, generation, round_)
        self.store.start_generation(GenerationEvent(generation, round=round_, reason=str(failure)))

    def serve_metrics(self) -> MetricsServer:
        registry = coordinator_registry(self.store, (self.config.num_workers, self.config.num_shards),
                                        self.config.link_mbps,
                                        lambda: self.plan, lambda: self.recovery.generation,
                                        lambda: self.retuner.counts() if self.retuner else None)
        return MetricsServer(registry, self.config.metrics_port, "coordinator", self.config.metrics_address(),
                             ports_file=self.config.ports_file)

    def resume(self) -> bool:
        """Take over a running job from Redis (this coordinator was restarted); False for a new job. A job that
        finished is refused: its name is taken, unless --fresh clears it."""
        if self.config.fresh:
            log.info("--fresh: deleted %d keys of job %s", self.store.clear_job(), self.config.job)
            return False
        finished = self.store.finished_at()
        if finished is not None or len(self.store.done_ranks()) >= self.config.num_workers:
            when = time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(finished)) if finished else ""
            raise JobFinished(f"job {self.config.job} already finished{when} in this Redis; give the new run "
                              f"another --job, or --fresh to start this name afresh")
        generation = self.store.generation()
        published = self.store.read_plan(FIRST_PLAN)
        if generation is None or published is None or published.plan is None:
            return False
        event = self.store.generation_event(generation)
        if event is not None and event.error:
            raise RecoveryImpossible(f"the job already failed in generation {generation}: {event.error}")
        first = published.plan
        self.recovery.generation, self.recovery.period = generation, first.period
        latest = self.store.latest_plan()
        if latest is None:  # the first plan was read above; only a store that lost it answers None
            return False
        self.plan = latest.result()
        if self.plan.version == FIRST_PLAN:
            layouts = self.store.layouts(self.config.num_workers)
            layout, options = check_layouts(layouts)
            if options.switches:  # the profile was not planned yet: plan it as the first run would
                self.plan = self.publish_cost_plan(layout, options, first, layouts[0].schedule)
        log.info("restarted: job %s is at generation %d with plan v%d; watching on", self.config.job, generation,
                 self.plan.version)
        return True

    def hold_job(self) -> threading.Thread:
        """Take the job's lease for this run's token (JobTaken where another run holds it) and keep renewing it
        until stopped; a restarted coordinator of the same run takes it over."""
        cfg = self.config
        lease = JobLease(cfg.job_token or self.token, f"{socket.gethostname()}:{os.getpid()}")
        held = self.store.claim_job(lease, cfg.heartbeat_ttl_s)
        if held is not None:
            raise JobTaken(held.refusal(cfg.job, "this coordinator"))

        def renew() -> None:
            while not self._stop.wait(cfg.heartbeat_ttl_s / 3):
                try:
                    held = self.store.claim_job(lease, cfg.heartbeat_ttl_s)
                    if held is not None:
                        log.error("the job's lease passed to another run (%s)", held.holder)
                except StoreError as exc:
                    log.warning("could not renew the job's lease: %s", exc)

        thread = threading.Thread(target=renew, daemon=True, name="imerge-job-lease")
        thread.start()
        return thread

    def run(self) -> int:
        started = time.monotonic()
        metrics = None
        try:
            self.hold_job()
            metrics = self.serve_metrics()
            if not self.resume():
                self.publish_plan()
            self.watch()
        except IMergeError as exc:
            log.error("%s", exc)
            return 1
        finally:
            if metrics is not None:
                metrics.close()
        self._stop.set()
        try:
            self.store.release_job(self.config.job_token or self.token)
        except StoreError as exc:
            log.warning("could not release the job's lease (it expires by itself): %s", exc)
        log.info("job %s finished after %.1fs", self.config.job, time.monotonic() - started)
        return 0
