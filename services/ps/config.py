"""The PS shard's configuration."""
from __future__ import annotations

import dataclasses

from imerge.config import CommonConfig, TlsConfig, option, require


@dataclasses.dataclass(frozen=True)
class PSConfig(TlsConfig, CommonConfig):
    shard_index: int = option(0, "index of this shard, 0-based")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "gRPC port to listen on (0: any free port)")
    advertise: str = option("", "address workers use to reach this shard (default: host:port)")
    pull_timeout_s: float = option(60.0, "longest a pull waits for the other workers' pushes")
    check_finite: bool = option(True, "reject gradients holding NaN or infinity")
    max_block_numel: int = option(1 << 28, "largest block, in elements, the shard accepts")
    max_workers: int = option(4096, "largest number of workers a block may declare")
    grace_s: float = option(5.0, "seconds in-flight calls get to finish on SIGTERM")
    register: bool = option(True, "register this shard's address in the coordinator's store")

    def __post_init__(self) -> None:
        CommonConfig.__post_init__(self)
        TlsConfig.__post_init__(self)
        require(self.shard_index >= 0, "shard_index", "must be >= 0")
        require(0 <= self.port < 65536, "port", "must be 0..65535")
        require(self.pull_timeout_s > 0, "pull_timeout_s", "must be positive")
        require(self.max_block_numel > 0, "max_block_numel", "must be positive")
        require(self.max_workers > 0, "max_workers", "must be positive")
        require(self.grace_s >= 0, "grace_s", "must be >= 0")
