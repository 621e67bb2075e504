"""DistributedDataParallel, simulated on the same links: ring all-reduce of 25 MiB buckets in backward order.

Buckets are DDP's: consecutive parameters in backward order up to 25 MiB, the
first one 1 MiB (:func:`imerge.core.planning.fuse_size`, the planner's own
DDP-style buckets). A bucket's all-reduce starts when its last gradient is
ready and after the bucket before it (one process group: one collective at a
time). A ring all-reduce of B bytes over W workers moves 2 (W - 1) / W x B
through every worker's uplink and downlink in 2 (W - 1) steps, each step a
message. The optimizer steps on every worker once every bucket is reduced.
"""
from __future__ import annotations

import math
import statistics

import simpy

from imerge.core.planning import BYTES_PER_ELEMENT, fuse_size, make_units

from .cluster import GBIT, Cluster, Constants
from .fluid import Fabric, Link, Process, data_path
from .profiles import ModelProfile
from .results import SimRun

BUCKET_CAP = 25 << 20
FIRST_BUCKET_CAP = 1 << 20


def ring_bytes(model_bytes: float, workers: int) -> float:
    """What a ring all-reduce moves through each worker's link, each direction."""
    return 2 * (workers - 1) / workers * model_bytes if workers > 1 else 0.0


class DDPJob:
    def __init__(self, profile: ModelProfile, cluster: Cluster, constants: Constants, iters: int, warmup: int):
        self.profile, self.cluster, self.k = profile, cluster, constants
        self.iters, self.warmup = iters, warmup
        self.env = simpy.Environment()
        self.fabric = Fabric(self.env, constants.cores)
        rate = cluster.worker_gbit * GBIT
        self.uplink, self.downlink = Link("w.up", rate), Link("w.down", rate)
        unit_bytes = [u.numel * BYTES_PER_ELEMENT for u in make_units(profile.layout())]
        self.buckets = fuse_size(unit_bytes, BUCKET_CAP, FIRST_BUCKET_CAP)
        self.bucket_bytes = [sum(unit_bytes[u] for u in bucket) for bucket in self.buckets]
        self.starts: list[float] = []
        self.host_cap = constants.host_gbit * GBIT if constants.host_gbit else math.inf
        # on real hosts a worker's ring costs CPU on each byte it sends and each it receives (weight 2)
        self.cpu = data_path("w.cpu", 0.0 if constants.cores else cluster.worker_cores, constants.ddp_cpu_per_byte)

    def run(self) -> SimRun:
        self.env.process(self._train())
        self.env.run()
        times = [b - a for a, b in zip(self.starts, self.starts[1:])]
        timed = times[self.warmup:] or times
        moved = ring_bytes(self.profile.nbytes, self.cluster.workers)
        return SimRun(timed, statistics.median(timed), statistics.fmean(timed), None, moved, self.env.now, 1, 0,
                      len(self.buckets))

    def _compute(self, seconds: float) -> simpy.Event:
        return self.fabric.compute(seconds, count=self.cluster.workers, cores=self.k.compute_cores)

    def _train(self) -> Process:
        forward_s = sum(u.forward_s for u in self.profile.units)
        for _ in range(self.iters):
            self.starts.append(self.env.now)
            yield self._compute(forward_s)
            previous: simpy.Event | None = None
            for bucket, nbytes in zip(self.buckets, self.bucket_bytes):
                yield self._compute(sum(self.profile.units[u].backward_s for u in bucket))
                previous = self.env.process(self._allreduce(nbytes, previous))
            if previous is not None:
                yield previous
            step_s = self.profile.nbytes * self.k.step_s_per_byte
            if step_s:
                yield self._compute(step_s)
        self.starts.append(self.env.now)

    def _allreduce(self, nbytes: int, previous: simpy.Event | None) -> Process:
        if previous is not None:
            yield previous
        workers = self.cluster.workers
        if workers == 1:
            return
        links = [(self.uplink, 1.0), (self.downlink, 1.0), *((link, 2.0) for link in self.cpu)]
        yield self.fabric.transfer([ring_bytes(nbytes, workers)], links,
                                   count=workers, cap=self.host_cap, cpu_per_byte=self.k.ring_cpu_per_byte)
        yield self.env.timeout(2 * (workers - 1) * self.k.ring_latency_s)
