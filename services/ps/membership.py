"""The shard's part in recovery: its heartbeat, its checkpoint rounds and the generation watch.

* A heartbeat key with a short TTL tells the coordinator the shard is alive;
  a dead or frozen (SIGSTOP) shard stops refreshing it and is declared lost.
* The rounds of the complete checkpoints on disk are published after every
  write, so the coordinator can pick the newest round every shard holds.
* A watcher thread waits (BLPOP, no polling) for the next generation's event;
  the shard then restores that event's checkpoint round and sets
  its restored message (empty, or the reason it could not).
* A shard that starts while the job is past generation 0 restores at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

from imerge.core.planning import FIRST_PLAN
from imerge.control.store import ShardStore
from imerge.control.messages import FailureReport, GenerationEvent, Member, Restored, common_round
from imerge.core.errors import IMergeError, StoreError, WaitTimeout

from .state import Shard

log = logging.getLogger(__name__)
RESTORE_TIMEOUT_S = 300.0
WATCH_WAIT_S = 0.2  # one wait for the next generation (an event ends it at once, and so does stop())


class ShardMembership:
    def __init__(self, store: ShardStore, shard: Shard, load_plan: Callable[[], Awaitable[None]],
                 loop: asyncio.AbstractEventLoop, heartbeat_ttl_s: float, checkpoint_failures: int = 0):
        self.store = store
        # the watcher's own connection: stop() closes it, which ends the watcher's blocking wait at once (a stop
        # otherwise waited out the rest of a WATCH_WAIT_S wait, 0.2 s of every shard's exit)
        self._watch_store = store.another_connection()
        self.shard = shard
        self._load_plan = load_plan  # coroutine function: reads the mapping table (the expected blocks)
        self.loop = loop
        self.ttl_s = heartbeat_ttl_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._handled = 0  # the newest generation restored or attempted
        self.checkpoint_failures = checkpoint_failures  # failed writes in a row that end the job (0: never)
        shard.on_checkpoint = self._published
        shard.held_in_common = self._held_in_common
        shard.on_checkpoint_failed = self._checkpoint_failed

    def _published(self, rounds: list[int]) -> None:
        try:
            self.store.publish_checkpoints(self.shard.index, rounds)
        except StoreError as exc:
            log.warning("shard %d: could not publish checkpoint rounds %s: %s", self.shard.index, rounds, exc)

    def _held_in_common(self) -> int | None:
        """The newest round every shard that published has complete: what a recovery restores now, which this
        shard's prune must not remove while it writes newer ones (a shard a checkpoint behind the others would
        otherwise leave no round in common). None where the store cannot say."""
        try:
            rounds = self.store.checkpoint_rounds()
        except StoreError as exc:
            log.warning("shard %d: could not read the shards' checkpoint rounds: %s", self.shard.index, exc)
            return None
        return common_round(rounds, max(rounds, default=-1) + 1)

    def _checkpoint_failed(self, round_: int, reason: str, in_a_row: int) -> None:
        """After --checkpoint-failures writes in a row failed, end the job: training on would only pile up work
        that no recovery could restore."""
        if not self.checkpoint_failures or in_a_row < self.checkpoint_failures:
            return
        why = (f"{in_a_row} checkpoints in a row failed (--checkpoint-failures {self.checkpoint_failures}), the "
               f"last of round {round_}: {reason}")
        try:
            self.store.report_failure(FailureReport(self.shard.generation, str(Member.shard(self.shard.index)), why,
                                                    fatal=True))
        except StoreError as exc:
            log.error("shard %d: could not report %s: %s", self.shard.index, why, exc)

    async def join(self) -> None:
        """At start, in a running job: publish this run's checkpoints on disk; restore if past generation 0."""
        await asyncio.to_thread(self.store.shard_heartbeat, self.shard.index, self.ttl_s,
                                self.shard.generation)
        generation = await asyncio.to_thread(self.store.generation)
        if generation is not None and await asyncio.to_thread(self.store.read_plan, FIRST_PLAN) is not None:
            await self._load_plan()
            if self.shard.checkpoints is not None:
                await asyncio.to_thread(self._published, self.shard.checkpoints.rounds())
        if generation:
            event = await asyncio.to_thread(self.store.generation_event, generation)
            await self.restore(event or GenerationEvent(generation))

    def start(self) -> None:
        for target, name in ((self._beat, "heartbeat"), (self._watch, "generations")):
            thread = threading.Thread(target=target, name=f"ps{self.shard.index}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._watch_store.close()
        for thread in self._threads:
            thread.join(10)

    async def restore(self, event: GenerationEvent) -> None:
        index, generation, round_ = self.shard.index, event.generation, event.round
        self._handled = max(self._handled, generation)
        try:
            if round_ is None:
                raise IMergeError(f"the event of generation {generation} names no checkpoint round: "
                                  f"{event.error or event}")
            await self._load_plan()
            checkpoint = await asyncio.to_thread(self.shard.load_checkpoint, round_)
            await self.shard.restore(generation, checkpoint)
            outcome = ""
        except IMergeError as exc:
            outcome = f"shard {index} could not restore generation {generation} from round {round_}: {exc}"
            log.error("%s", outcome)
        if outcome and round_ is not None and self.shard.checkpoints is not None:
            await asyncio.to_thread(self._fall_back, round_)
        await asyncio.to_thread(self.store.announce_restored, Restored(generation, index, outcome))
        if outcome and round_ is not None:  # the coordinator starts another generation, from an older round
            await asyncio.to_thread(self.store.report_failure,
                                    FailureReport(generation, str(Member.shard(index)), outcome))
        await asyncio.to_thread(self.store.shard_heartbeat, index, self.ttl_s, self.shard.generation)

    def _fall_back(self, round_: int) -> None:
        """A checkpoint this shard cannot read is set aside, and the rounds it can are published again (before
        the failure is reported), so the recovery that follows picks the newest round every shard still holds."""
        checkpoints = self.shard.checkpoints
        if checkpoints is None:  # only a shard with checkpoints restores one
            return
        checkpoints.quarantine(round_)
        self._published(checkpoints.rounds())

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.store.shard_heartbeat(self.shard.index, self.ttl_s, self.shard.generation)
            except StoreError as exc:
                log.warning("shard %d: heartbeat failed: %s", self.shard.index, exc)

    def _watch(self) -> None:
        while not self._stop.is_set():
            target = max(self.shard.generation, self._handled) + 1
            try:
                event = self._watch_store.wait_generation(target, WATCH_WAIT_S, f"generation {target}")
                latest = self._watch_store.generation() or target
                if latest > target:  # several recoveries meanwhile: go to the newest
                    target, event = latest, self._watch_store.generation_event(latest) or GenerationEvent(latest)
            except WaitTimeout:
                continue
            except Exception as exc:
                if self._stop.is_set():  # stop() closed the connection under the call, from another thread:
                    return  # redis-py then fails in its own ways (ConnectionError, its parser's buffer gone)
                if not isinstance(exc, StoreError):
                    raise
                log.warning("shard %d: watching the job generation: %s", self.shard.index, exc)
                self._stop.wait(1.0)
                continue
            if event.error:  # the job ended: there is nothing to restore; the calls still waiting end now
                self._handled = max(self._handled, target)
                log.error("shard %d: the job failed: %s", self.shard.index, event.error)
                with contextlib.suppress(RuntimeError):  # the loop closed: the shard stopped
                    self.loop.call_soon_threadsafe(self.shard.fail_job, event.error)
                continue
            log.info("shard %d: the job moved to generation %d", self.shard.index, target)
            future = asyncio.run_coroutine_threadsafe(self.restore(event), self.loop)
            try:
                future.result(RESTORE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - logged; the workers see no restored event and time out
                log.exception("shard %d: restoring generation %d failed", self.shard.index, target)
