"""The worker's configuration."""
from __future__ import annotations

import dataclasses

from collections.abc import Mapping

from imerge.core.config import CommonConfig, ThreadPolicyConfig, TlsConfig, flag_name, option, require
from imerge.core.errors import ConfigError
from imerge.core.planning import PlanOptions
from imerge.core.schedule_config import MIB, ScheduleConfig

__all__ = ["MIB", "ScheduleConfig", "WorkerConfig", "torchrun_identity"]
TORCHRUN = "TORCHELASTIC_RUN_ID"  # torchrun (torch.distributed.run) sets it in every process it starts


@dataclasses.dataclass(frozen=True)
class WorkerConfig(ScheduleConfig, ThreadPolicyConfig, TlsConfig, CommonConfig):
    rank: int = option(0, "this worker's rank, 0-based", aliases=("RANK",))
    world_size: int = option(1, "number of workers in the job", aliases=("WORLD_SIZE",))
    pull_timeout_s: float = option(60.0, "longest a pull waits for the other workers")
    rpc_timeout_s: float = option(30.0, "deadline of a push, an init or a fetch")
    heartbeat_ttl_s: float = option(10.0, "lifetime of this worker's heartbeat key")
    local_rank: int = option(-1, "this worker's rank on its node, which picks its GPU (-1: the rank modulo the "
                                 "node's GPUs)", aliases=("LOCAL_RANK",))
    nproc_per_node: int = option(1, "imerge worker: start this many worker processes on this node (one per GPU), "
                                    "ranks node_rank * N + i with local rank i, and wait for them")
    node_rank: int = option(-1, "with --nproc-per-node > 1: this node's index (default: --rank)")

    def plan_options(self, link_mbps: float | None = None) -> PlanOptions:
        """The options the plan depends on, for this worker's own link (``--link-mbps``) unless told another."""
        return ScheduleConfig.plan_options(self, self.link_mbps if link_mbps is None else link_mbps)

    def __post_init__(self) -> None:
        CommonConfig.__post_init__(self)
        TlsConfig.__post_init__(self)
        ScheduleConfig.__post_init__(self)
        require(self.world_size >= 1, "world_size", "must be at least 1")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in 0..{self.world_size - 1}")
        require(self.pull_timeout_s > 0, "pull_timeout_s", "must be positive")
        require(self.rpc_timeout_s > 0, "rpc_timeout_s", "must be positive")
        require(self.heartbeat_ttl_s > 0, "heartbeat_ttl_s", "must be positive")
        require(self.local_rank >= -1, "local_rank", "must be >= 0 (or -1: the rank modulo the node's GPUs)")
        require(self.nproc_per_node >= 1, "nproc_per_node", "must be at least 1")
        if self.nproc_per_node > 1:
            node = self.node_rank if self.node_rank >= 0 else self.rank
            require((node + 1) * self.nproc_per_node <= self.world_size, "nproc_per_node",
                    f"node {node} with {self.nproc_per_node} processes needs ranks up to "
                    f"{(node + 1) * self.nproc_per_node - 1}, but --world-size is {self.world_size}")


def torchrun_identity(env: Mapping[str, str]) -> dict[str, int]:
    """Under torchrun, its RANK, WORLD_SIZE and LOCAL_RANK are the worker's identity, over IMERGE_RANK and
    IMERGE_LOCAL_RANK (which a pod may carry for itself: the chart's, when torchrun runs a process per GPU in
    it); an IMERGE_WORLD_SIZE that disagrees with torchrun's WORLD_SIZE is an error naming both."""
    if not env.get(TORCHRUN):
        return {}
    try:
        identity = {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                    "local_rank": int(env.get("LOCAL_RANK", "-1"))}
    except (KeyError, ValueError):
        raise ConfigError("RANK", f"torchrun ({TORCHRUN} is set) gives RANK and WORLD_SIZE as integers; got RANK="
                                  f"{env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}") from None
    ours = env.get("IMERGE_WORLD_SIZE", "")
    if ours and ours.strip() != str(identity["world_size"]):
        raise ConfigError(flag_name("world_size"), f"IMERGE_WORLD_SIZE is {ours} but torchrun's WORLD_SIZE is "
                                                   f"{identity['world_size']}: the job's workers are every process "
                                                   "torchrun starts on every node; make the two agree")
    return identity
