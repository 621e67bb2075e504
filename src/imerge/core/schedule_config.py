"""The scheduler's options, shared by the worker (``imerge worker``) and the simulator (``imerge simulate``).

Every mechanism can be switched off to measure what it buys; a strategy of
``imerge bench`` and ``imerge simulate`` is a set of these options
(:mod:`imerge.core.strategies`).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Self

from imerge.core.modes import MODES, CompressionSpec
from imerge.core.config import DEFAULT_LINK_MBPS, check_choices, option, require
from imerge.core.knobs import JOB_KNOBS, TUNE_AUTO, TUNE_NONE, free_job_knobs, parse_tune
from imerge.core.planning import FUSIONS, PLACEMENTS, PlanOptions, auto_partition_bytes
from imerge.core.slots import SLOT_SCOPES, SLOTS

BUFFER_MODES = ("broadcast", "average", "off")  # model buffers: see the worker's model_buffers
MIB = 1 << 20
DATA_PATHS = ("socket", "grpc")  # see imerge.wire.datapath
COMPRESSION_OPTIONS = {"topk_ratio": ("topk", "mixed"), "topk_pull_ratio": ("topk", "mixed"),
                       "mixed_threshold_kib": ("mixed",)}  # option -> the modes it applies to


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The scheduler's options: every mechanism can be switched off to measure what it buys."""

    tune: str = option(TUNE_AUTO, "the knobs the coordinator chooses for the job from its first --profile-iters "
                                  "iterations, by simulating the candidates on the measured profile: auto (each of "
                                  f"{', '.join(JOB_KNOBS)} that no option gives explicitly; fusion only at "
                                  "--interleave-period 1), none (the options as given), or a comma list of them",
                       )
    retune_window: int = option(20, "with --tune: every this many iterations worker 0 reports the window's mean "
                                     "iteration time; where it drifts from the prediction the coordinator decides "
                                     "again with the new measurements and may switch the schedule (0: decide once)")
    fusion: str = option("none", "fusion planner: none (one group per module), size (byte cap), "
                                 "cost (profiled cost model)", choices=FUSIONS)
    size_cap_mib: float = option(25.0, "byte cap of a group with --fusion size, MiB")
    first_cap_mib: float = option(1.0, "byte cap of the first group with --fusion size, MiB")
    partition_mib: float = option(0.0, "blocks larger than this are split into partitions (a multiple of the "
                                       "shard count per split layer), MiB; 0: from --link-mbps, the bytes of 4 ms "
                                       "on the link between 1 and 8 MiB (1 MiB up to 2 Gbit/s, 4.8 at 10)")
    placement: str = option("lpt", "block placement: lpt (blocks of at most the partition, smaller where the shards "
                            "are many, largest first onto the least loaded shard of their phase), stripe (every "
                            "shard exactly the same bytes of each phase in fewer blocks, but a group's layers on "
                            "consecutive shards) or round-robin",
                            choices=PLACEMENTS)
    interleave_period: int = option(1, "T: each group syncs every T iterations (local SGD in between)")
    overlap: bool = option(True, "push each group during backward and wait in the next forward; off: push "
                                 "and pull everything after backward, then wait (a naive PS, for comparison)")
    priority: bool = option(True, "send first the groups the next forward needs first")
    slots: str = option("off", "intra-iteration interleave: off, fixed (hold a group's flag for its slot "
                               "time) or ack (until the shard acknowledged the push)", choices=SLOTS)
    slot_scope: str = option("shard", "what a slot flag guards: shard (every push to the shard's port) or "
                                      "group (a group's pushes to one shard; the workers take a group's "
                                      "shards in turn)", choices=SLOT_SCOPES)
    slot_width: int = option(0, "workers that may hold the same slot at once (worker w takes lane w mod k); "
                                "0: with scope shard as many as there are shards (a worker's uplink is spread "
                                "over the shards, so a port takes that many senders at full rate), with scope "
                                "group 1; no flags at all where the width admits every worker")
    slot_bandwidth_mbps: float = option(0.0, "shard ingress bandwidth for fixed slots, Mbit/s "
                                             "(0: measured online from the pushes)")
    flag_lease_s: float = option(10.0, "lease of a slot flag: a dead holder frees it after this")
    profile_iters: int = option(5, "iterations profiled before --fusion cost plans the groups")
    profile_out: str = option("", "worker 0 writes its profile of the first --profile-iters iterations to this JSON "
                                  "file (each module's forward and backward time, the push cost): the input of "
                                  "imerge simulate --profile")
    trace_dir: str = option("", "write this worker's timeline as Chrome trace JSON into this folder")
    data_path: str = option("socket", "how pushes and pulls travel: socket (each shard's data channel: TCP "
                                      "connections beside gRPC that carry the raw bytes) or grpc (gRPC streams, "
                                      "where only the shards' gRPC port can be reached)", choices=DATA_PATHS)
    compression: str = option("none", "what travels on the wire (docs/compression.md): none (fp32), fp16 or bf16 "
                                      "(gradients and parameters in that dtype), topk (the --topk-ratio largest "
                                      "gradient elements with error feedback; pulls send the parameters that "
                                      "changed), mixed (groups under --mixed-threshold-kib fp16, larger ones topk)",
                              choices=MODES)
    topk_ratio: float = option(0.01, "with --compression topk or mixed: the fraction of a block's gradient elements "
                                     "pushed (the largest by magnitude)")
    topk_pull_ratio: float = option(0.0, "with --compression topk or mixed: the most a pull sends of a block, as a "
                                          "fraction of its parameters (the largest changes since what the workers "
                                          "hold; the rest follow in later pulls); 0: every parameter that changed, "
                                          "so the workers' copies stay exact")
    mixed_threshold_kib: float = option(256.0, "with --compression mixed: groups smaller than this (fp32 KiB) "
                                               "travel fp16, larger ones topk")
    buffers: str = option("broadcast", "model buffers (BatchNorm statistics): broadcast (worker 0's before every "
                                       "forward, as DDP's broadcast_buffers), average (the workers' mean), or off",
                          choices=BUFFER_MODES)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.tune != TUNE_AUTO:
            try:
                parse_tune(self.tune)
            except ValueError as exc:
                require(False, "tune", str(exc))
        for name in ("size_cap_mib", "first_cap_mib"):
            require(math.isfinite(getattr(self, name)) and getattr(self, name) * MIB >= 4, name,
                    "must be a finite size of at least 4 bytes")
        require(self.partition_mib == 0 or (math.isfinite(self.partition_mib) and self.partition_mib * MIB >= 4),
                "partition_mib", "must be a finite size of at least 4 bytes (or 0: from --link-mbps)")
        require(self.interleave_period >= 1, "interleave_period", "must be at least 1")
        require(self.slot_width >= 0, "slot_width", "must be >= 0 (0: the number of shards)")
        require(self.slot_bandwidth_mbps >= 0, "slot_bandwidth_mbps", "must be >= 0")
        require(self.flag_lease_s > 0, "flag_lease_s", "must be positive")
        require(self.profile_iters >= 2, "profile_iters", "must be at least 2")
        require(self.retune_window >= 0, "retune_window", "must be >= 0 (0: decide once)")
        require(not self.profile_out or Path(self.profile_out).resolve().parent.is_dir(), "profile_out",
                f"{self.profile_out}: its folder does not exist")
        require(0 < self.topk_ratio <= 1, "topk_ratio", "must lie in (0, 1]")
        require(self.mixed_threshold_kib >= 0, "mixed_threshold_kib", "must be >= 0")
        require(0 <= self.topk_pull_ratio <= 1, "topk_pull_ratio", "must lie in [0, 1]")
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        for name, modes in COMPRESSION_OPTIONS.items():
            require(self.compression in modes or getattr(self, name) == defaults[name], name,
                    f"has no effect with --compression {self.compression} (only with {' or '.join(modes)})")
        require(self.interleave_period == 1 or self.compression in ("none", "fp16", "bf16"), "compression",
                f"{self.compression} needs --interleave-period 1: a top-k pull sends only the parameters the "
                "shard changed, which would leave a worker's local steps in place")

    def compression_spec(self) -> CompressionSpec:
        return CompressionSpec(self.compression, self.topk_ratio, int(self.mixed_threshold_kib * 1024),
                               self.topk_pull_ratio)

    def tuned(self, explicit: set[str]) -> Self:
        """``--tune auto`` resolved: the job knobs none of whose fields are in ``explicit`` (the options given by a
        flag, an IMERGE_* variable or a keyword), or 'none'. A resolved value is kept."""
        if self.tune != TUNE_AUTO:
            return self
        return dataclasses.replace(self, tune=",".join(free_job_knobs(explicit, self.interleave_period)) or TUNE_NONE)

    def explicit_fields(self) -> set[str]:
        """Where no one said what was given explicitly (a config object built in code): the fields that differ
        from their defaults."""
        return {f.name for f in dataclasses.fields(ScheduleConfig) if getattr(self, f.name) != f.default}

    @property
    def tuned_knobs(self) -> list[str]:
        """The knobs the coordinator may choose for this job."""
        return parse_tune(self.tuned(self.explicit_fields()).tune)

    def partition_bytes(self, link_mbps: float) -> int:
        """The partition cap: ``--partition-mib``, or where it is 0 the one for a worker link of ``link_mbps``."""
        return int(self.partition_mib * MIB) if self.partition_mib else auto_partition_bytes(link_mbps)

    def plan_options(self, link_mbps: float = DEFAULT_LINK_MBPS) -> PlanOptions:
        """The options the plan depends on, for workers whose links carry ``link_mbps`` (``--link-mbps``)."""
        return PlanOptions(fusion=self.fusion, size_cap_bytes=int(self.size_cap_mib * MIB),
                           first_cap_bytes=int(self.first_cap_mib * MIB),
                           partition_bytes=self.partition_bytes(link_mbps), placement=self.placement,
                           period=self.interleave_period, tune=",".join(self.tuned_knobs),
                           retune_window=self.retune_window if self.tuned_knobs else 0)
