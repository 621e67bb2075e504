"""The named strategies of ``imerge bench`` and ``imerge simulate``: each one a set of scheduler options
(:class:`imerge.core.schedule_config.ScheduleConfig` fields) over the defaults. Pure data.

``ddp`` is the baseline (torch DistributedDataParallel), not a set of options.
"""
from __future__ import annotations

import dataclasses
from typing import Any

TCP_CONGESTION = "cubic"  # Linux's default; the host's own setting (some hosts run bbr) is not inherited
SHALLOW = 16.0  # kB: a shallow switch port queue that drops under incast

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "auto": {},  # the defaults: --tune auto chooses fusion, priority and slots from the job's profile
    "ps-naive": dict(fusion="none", overlap=False, priority=False, slots="off"),
    "wfbp": dict(fusion="none", priority=False, slots="off"),
    "size": dict(fusion="size", priority=False, slots="off"),
    "imerge": dict(fusion="cost", priority=True, slots="ack"),
    "imerge-fixed": dict(fusion="cost", priority=True, slots="fixed"),
    "imerge-group": dict(fusion="cost", priority=True, slots="ack", slot_scope="group", slot_width=1),
    "imerge-noslots": dict(fusion="cost", priority=True, slots="off"),
    "imerge-T2": dict(fusion="cost", priority=True, slots="ack", interleave_period=2),
    "imerge-T4": dict(fusion="cost", priority=True, slots="ack", interleave_period=4),
}
SCHEDULES = tuple(STRATEGIES)  # the strategies without compression
STRATEGIES.update({f"imerge-{mode}": dict(fusion="cost", priority=True, slots="ack", compression=mode)
                   for mode in ("fp16", "bf16", "topk", "mixed")})
STRATEGIES["imerge-topk-pull"] = dict(STRATEGIES["imerge-topk"], topk_pull_ratio=0.01)
STRATEGIES["imerge-grpc"] = dict(STRATEGIES["imerge"], data_path="grpc")  # the data path of gRPC streams
INCAST = {f"slots-{mode}": dict(fusion="cost", priority=True, slots=mode) for mode in ("off", "fixed", "ack")}
INCAST["slots-ack-group"] = STRATEGIES["imerge-group"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str
    batch_size: int
    workers: int
    shards: int
    rate_mbit: float = 1000.0
    iters: int = 12
    shard_queue_kb: float = 0.0
    mtu: int = 9000
    tcp_congestion: str = TCP_CONGESTION
    strategies: tuple[str, ...] = tuple(STRATEGIES)
    sizes: tuple[int, ...] = ()  # scaling: run at each worker count, shards = workers


SCENARIOS = {
    "B1": Scenario("resnet18", 8, 3, 3),
    "B2": Scenario("vgg", 8, 3, 3),
    "B3": Scenario("resnet18", 8, 6, 1, shard_queue_kb=SHALLOW, mtu=1500, strategies=("auto", *INCAST)),
    "B4": Scenario("resnet18", 8, 1, 1, sizes=(1, 2, 3, 4, 5, 6)),
    # the strategies whose paths differ on a real network (the slot variants and T > 1 are checked in-process)
    "tiny": Scenario("digits-cnn", 16, 2, 1, rate_mbit=100.0, iters=12,
                     strategies=("ddp", "imerge", "imerge-grpc", "imerge-topk")),
}


def warmup_iterations(iters: int) -> int:
    """Iterations not timed: warm-up, and the profile of fusion cost (which runs that long)."""
    return min(5, max(2, iters // 4))


def untimed_iterations(iters: int) -> int:
    """Iterations a measurement of a PS strategy leaves out: the warm-up and the one after it. A plan switch
    (fusion cost's, --tune's) synchronizes every push at the warm-up's end, so the next iteration waits for
    nothing and reads fast; the benchmark and the simulator leave it out for every strategy alike."""
    return warmup_iterations(iters) + 1
