"""The worker's configuration."""
from __future__ import annotations

import dataclasses

from imerge.config import CommonConfig, option, require


@dataclasses.dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    rank: int = option(0, "this worker's rank, 0-based", aliases=("RANK",))
    world_size: int = option(1, "number of workers in the job", aliases=("WORLD_SIZE",))
    pull_timeout_s: float = option(60.0, "longest a pull waits for the other workers")
    rpc_timeout_s: float = option(30.0, "deadline of a push, an init or a fetch")
    heartbeat_ttl_s: float = option(10.0, "lifetime of this worker's heartbeat key")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.world_size >= 1, "world_size", "must be at least 1")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in 0..{self.world_size - 1}")
        require(self.pull_timeout_s > 0, "pull_timeout_s", "must be positive")
        require(self.rpc_timeout_s > 0, "rpc_timeout_s", "must be positive")
        require(self.heartbeat_ttl_s > 0, "heartbeat_ttl_s", "must be positive")

