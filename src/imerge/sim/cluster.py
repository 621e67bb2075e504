"""What a simulation runs on: the cluster (workers, shards, links) and the constants calibrated on a testbed. Pure."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from imerge.core.errors import ConfigError

GBIT = 1e9 / 8  # bytes per second


@dataclasses.dataclass(frozen=True)
class Cluster:
    """W workers and S shards, each host behind its own full-duplex link to one switch."""

    workers: int
    shards: int
    worker_gbit: float = 10.0
    shard_gbit: float = 10.0
    queue_kb: float = 0.0  # the switch port queue in front of a host (0: deep enough never to drop)
    mtu: int = 9000
    shard_cores: float = 1.0   # cores a shard host's data path uses: its shard processes (or --threads); 0: free
    worker_cores: float = 1.0  # cores a worker's data path uses (its data connections' threads); 0: free

    def __post_init__(self) -> None:
        if self.workers < 1 or self.shards < 1:
            raise ConfigError("workers", "a cluster needs at least one worker and one shard")
        if self.worker_gbit <= 0 or self.shard_gbit <= 0:
            raise ConfigError("link_gbit", "link rates must be positive")
        if self.queue_kb < 0 or self.mtu < 576:
            raise ConfigError("queue_kb", "the queue must be >= 0 kB and the MTU at least 576")
        if not (0 <= self.shard_cores < math.inf and 0 <= self.worker_cores < math.inf):
            raise ConfigError("shard_cores", "a data path's cores must be >= 0 (0: its CPU is not counted)")

    @property
    def incast_senders(self) -> float:
        """Concurrent senders a port's queue absorbs: two packets each (a TCP window after a loss)."""
        return math.inf if not self.queue_kb else max(1.0, self.queue_kb * 1000 / (2 * self.mtu))


SHARED_CORE_COSTS = frozenset({"cpu_per_byte", "dense_cpu_per_byte", "ring_cpu_per_byte", "ring_latency_s",
                               "topk_cpu_per_byte", "compute_cores", "sync_cpu_s"})


@dataclasses.dataclass(frozen=True)
class Constants:
    """What the network model cannot derive from the cluster; ``imerge bench ... --calibrate`` fits them to
    testbed runs. The defaults describe a cluster of real hosts: each its own processor, no shared cores."""

    latency_s: float = 50e-6        # one way, per PS message (switch, stacks, gRPC framing, the Python that sends it)
    ring_latency_s: float = 50e-6   # one way, per step of DDP's ring (switch, stacks, gloo)
    flag_rtt_s: float = 200e-6      # a slot flag's take or release: one round trip to Redis
    sync_cpu_s: float = 0.0         # core seconds a group's sync costs per shard it touches, whatever its bytes: the
    #                                 pull request and push stream, the Futures and hooks around them, both ends
    #                                 (fitted on the testbed's shared cores; on real hosts not measured: 0)
    incast_efficiency: float = 0.5  # goodput of a port whose queue overflows (losses, retransmission timeouts)
    cores: float = 0.0              # cores every role shares (the testbed: this machine's); 0: each host its own
    cpu_per_byte: float = 0.0       # with shared cores: core seconds per byte a PS push or pull moves (both ends)
    dense_cpu_per_byte: float = 0.0  # ... and per byte of the fp32 blocks it carries, whatever their wire size
    ring_cpu_per_byte: float = 0.0  # with shared cores: the same for DDP's ring all-reduce (gloo, in C++ threads)
    topk_cpu_per_byte: float = 0.0  # top-k selection, per byte of the dense block: a worker's push, a shard's
    #                                 pull with --topk-pull-ratio (imerge bench compression measures it)
    compute_cores: float = 1.0      # with shared cores: the cores a worker's forward and backward keep busy
    step_s_per_byte: float = 0.0    # an optimizer step per parameter byte (shards; DDP's and T > 1's local steps)
    host_gbit: float = 0.0          # the most one flow of a host's data path moves (0: only the link limits it)
    # On real hosts (cores = 0), every process's data path spends CPU on each byte it sends or receives, across
    # all its flows, on the cores the cluster gives it (``shard_cores``, ``worker_cores``): core seconds per
    # byte, as `imerge bench datapath --rounds 3` measured them (commit 9a0786a: the data channel, whose connection
    # threads carry the pushes, pulls and steps, and gRPC's path, on the native data plane, freed pages kept,
    # threads under SCHED_BATCH, blocks of 4 ms of a 10 Gbit/s link; gloo, with the same allocator setting;
    # docs/benchmarks.md, issue 46).
    shard_cpu_per_byte: float = 0.28e-9       # a shard process, --data-path socket
    worker_cpu_per_byte: float = 0.34e-9      # a worker process, --data-path socket
    grpc_shard_cpu_per_byte: float = 0.68e-9  # the same on gRPC's data path (--data-path grpc)
    grpc_worker_cpu_per_byte: float = 0.64e-9
    ddp_cpu_per_byte: float = 0.46e-9         # a DDP worker's gloo ring, per byte it sends or receives

    def data_path_costs(self, data_path: str) -> tuple[float, float]:
        """(shard, worker) core seconds per byte on real hosts for ``data_path`` (socket or grpc)."""
        if data_path == "grpc":
            return self.grpc_shard_cpu_per_byte, self.grpc_worker_cpu_per_byte
        return self.shard_cpu_per_byte, self.worker_cpu_per_byte

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def read(cls, path: str | Path) -> "Constants":
        try:
            raw: Any = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("calibration", f"cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("calibration", f"{path} is not JSON: {exc}") from None
        values = raw.get("constants", raw) if isinstance(raw, dict) else None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or not set(values) <= names:
            unknown = sorted(set(values) - names) if isinstance(values, dict) else []
            raise ConfigError("calibration", f"{path}: not a calibration (expected the keys {', '.join(sorted(names))}"
                                             + (f"; unknown: {', '.join(unknown)}" if unknown else "") + ")")
        missing = sorted(SHARED_CORE_COSTS - set(values)) if values.get("cores") else []
        if missing:  # left at 0, these would cost nothing on the shared cores: a calibration of an older model
            raise ConfigError("calibration", f"{path}: a calibration with shared cores needs {', '.join(missing)} "
                                             "too (written by an older imerge simulate calibrate? fit it again)")
        try:
            constants = cls(**{k: float(v) for k, v in values.items()})
        except (TypeError, ValueError):
            raise ConfigError("calibration", f"{path}: every constant must be a number") from None
        if any(not math.isfinite(v) or v < 0 for v in dataclasses.astuple(constants)):
            raise ConfigError("calibration", f"{path}: every constant must be finite and >= 0")
        return constants
