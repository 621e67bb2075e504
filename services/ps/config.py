"""The PS shard's configuration."""
from __future__ import annotations

import dataclasses

from imerge.core.config import CommonConfig, ThreadPolicyConfig, TlsConfig, option, require
from imerge.core.native import CHOICES

from .turns import PULL_ORDERS


@dataclasses.dataclass(frozen=True)
class PSConfig(ThreadPolicyConfig, TlsConfig, CommonConfig):
    shard_index: int = option(0, "index of this shard, 0-based")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "gRPC port to listen on (0: any free port)")
    data_port: int = option(0, "port of the data channel, which carries the bytes of pushes and pulls beside "
                               "gRPC (0: any free port; -1: none, the workers must use --data-path grpc)")
    max_data_connections: int = option(1024, "data connections open at once (workers x calls in flight, with "
                                             "room): when every place is held by a worker's connection, one "
                                             "more is refused with UNAVAILABLE, which the worker retries")
    max_pending_data_connections: int = option(64, "data connections not yet through their HELLO at once (the "
                                                   "rest of --max-data-connections is kept for workers); a new "
                                                   "one beyond it ends the oldest")
    handshake_timeout_s: float = option(5.0, "a data connection must complete its TLS handshake and its HELLO "
                                             "within this many seconds of its accept, or it is ended")
    advertise: str = option("", "address workers use to reach this shard (default: host:port)")
    pull_timeout_s: float = option(60.0, "longest a pull waits for the other workers' pushes")
    max_pull_timeout_s: float = option(600.0, "longest wait a pull may ask for (a longer timeout_s is cut to this)")
    check_finite: bool = option(True, "reject gradients holding NaN or infinity")
    max_block_numel: int = option(1 << 28, "largest block, in elements, the shard accepts")
    max_workers: int = option(4096, "largest number of workers a block may declare")
    threads: int = option(0, "threads of the shard's arithmetic: blocks averaged and stepped at once, each on one "
                             "core (0: one per core); the data channel reads on a thread per connection")
    data_plane: str = option("auto", "what receives the payloads and sums the rows: native (the C extension "
                                     "pip install builds where a C compiler exists; the shard refuses to start "
                                     "without it), python, or auto (native where built, else python, logged once)")
    pull_order: str = option("auto", "the order in which pulls on the data channel share this shard's uplink: "
                                     "arrival (a pull's blocks go out before those of pulls asked after it, "
                                     "while it has bytes queued on this host: the first worker to ask has "
                                     "its parameters at the link's full rate and pushes again while the next "
                                     "one's go out), off (the connections share the uplink as TCP does) or "
                                     "auto (arrival where this shard is the job's only one, else off: several "
                                     "shards would all serve the same worker first)")
    grace_s: float = option(5.0, "seconds in-flight calls get to finish on SIGTERM")
    register: bool = option(True, "register this shard's address in the coordinator's store")
    checkpoint_dir: str = option("", "folder of this job's checkpoints (shard-{i}/ under it); empty: none, "
                                     "and no recovery")
    checkpoint_every: int = option(10, "write a checkpoint every this many rounds (when all blocks agree)")
    checkpoint_keep: int = option(2, "complete checkpoints kept (the newest)")
    checkpoint_failures: int = option(3, "failed checkpoint writes in a row (a full disk) after which the shard "
                                         "ends the job with the reason (0: never; each failure is logged and "
                                         "counted in imerge_shard_checkpoint_failures_total)")
    stream_idle_s: float = option(10.0, "a client stream (push, init, import) that sends nothing for this long "
                                        "ends with DEADLINE_EXCEEDED and frees what it held")
    stream_min_bytes_per_s: float = option(16384.0, "a push, init or import stream (or a data-channel payload) "
                                                    "that moves less than this over a window of --stream-idle-s "
                                                    "ends with DEADLINE_EXCEEDED, and one holding a worker's row "
                                                    "is superseded by that worker's newer push once it moved less "
                                                    "than this over a second (0: no minimum)")
    tls_worker_identity: bool = option(False, "strict mutual TLS: a push or pull naming worker w must come with a "
                                              "client certificate that names worker-<w> (its CN or a DNS SAN, "
                                              "alone or as the first label: worker-3.imerge.svc)")
    heartbeat_ttl_s: float = option(3.0, "lifetime of this shard's heartbeat key; a frozen or dead shard is "
                                         "declared lost after it")

    def __post_init__(self) -> None:
        CommonConfig.__post_init__(self)
        TlsConfig.__post_init__(self)
        require(self.shard_index >= 0, "shard_index", "must be >= 0")
        require(0 <= self.port < 65536, "port", "must be 0..65535")
        require(-1 <= self.data_port < 65536, "data_port", "must be 0..65535, or -1 for none")
        require(self.pull_timeout_s > 0, "pull_timeout_s", "must be positive")
        require(self.max_pull_timeout_s >= self.pull_timeout_s, "max_pull_timeout_s", "must be at least "
                "--pull-timeout-s")
        require(self.max_block_numel > 0, "max_block_numel", "must be positive")
        require(self.max_workers > 0, "max_workers", "must be positive")
        require(self.grace_s >= 0, "grace_s", "must be >= 0")
        require(1 <= self.max_data_connections <= 1 << 16, "max_data_connections", "must lie in 1..65536")
        require(1 <= self.max_pending_data_connections <= 1 << 16, "max_pending_data_connections",
                "must lie in 1..65536 (at most --max-data-connections are used)")
        require(self.handshake_timeout_s > 0, "handshake_timeout_s", "must be positive")
        require(self.data_plane in CHOICES, "data_plane", f"must be one of {', '.join(CHOICES)}")
        require(self.pull_order in PULL_ORDERS, "pull_order", f"must be one of {', '.join(PULL_ORDERS)}")
        require(self.threads >= 0, "threads", "must be >= 0 (0: one per core)")
        require(self.checkpoint_every >= 1, "checkpoint_every", "must be at least 1")
        require(self.checkpoint_keep >= 2, "checkpoint_keep", "must be at least 2 (the previous checkpoint "
                                                              "stays valid while the next is written)")
        require(not self.tls_worker_identity or bool(self.tls_ca), "tls_worker_identity",
                "needs mutual TLS (--tls-cert, --tls-key and --tls-ca): the identity comes from the client's "
                "certificate")
        require(self.checkpoint_failures >= 0, "checkpoint_failures", "must be >= 0")
        require(self.stream_idle_s > 0, "stream_idle_s", "must be positive")
        require(self.stream_min_bytes_per_s >= 0, "stream_min_bytes_per_s", "must be >= 0 (0: no minimum)")
        require(self.heartbeat_ttl_s > 0, "heartbeat_ttl_s", "must be positive")

    def pull_wait(self, requested_s: float) -> float:
        """How long a pull that asks for ``requested_s`` (0: the default) waits."""
        return min(requested_s if requested_s > 0 else self.pull_timeout_s, self.max_pull_timeout_s)
