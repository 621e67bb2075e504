"""The shard's facet of the store: its address and heartbeat, its checkpoint rounds, a restore's outcome, and the
round scalars the shards exchange."""
from __future__ import annotations

import time

from ..messages import CheckpointRounds, PostedScalars, Restored, RoundScalars
from .base import StoreBase, _translated


class ShardStore(StoreBase):
    """What ps writes (ROLE_WRITES["ps"]), besides what every role may read."""

    # -- shards -------------------------------------------------------------
    @_translated
    def register_shard(self, index: int, address: str) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self._key("shards"), str(index), address)
        pipe.rpush(self._key("shards", "queue"), str(index))
        pipe.execute()

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

    # -- generations and recovery ------------------------------------------------
    @_translated
    def announce_restored(self, message: Restored) -> None:
        self._set_event(f"restored:{message.generation}:{message.shard}", message.encode())

    @_translated
    def shard_heartbeat(self, index: int, ttl_s: float, generation: int) -> None:
        self._redis.set(self._key("shard", index, "alive"), str(generation), px=int(ttl_s * 1000))

    @_translated
    def publish_checkpoints(self, index: int, rounds: list[int]) -> None:
        self._redis.hset(self._key("checkpoints"), str(index), CheckpointRounds(rounds).encode())
