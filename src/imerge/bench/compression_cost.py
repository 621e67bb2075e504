"""``imerge bench compression``: the CPU each compression mode costs, against the bytes it saves.

In one process, on a model's gradient cut into blocks as a plan cuts them
(``--partition-mib``, default 1 MiB): per iteration, what a worker spends
compressing every block (cast, or top-k with its residual) and what the shards
spend, summed over all of them, receiving the workers' payloads (decode, widen
or keep sparse), averaging them and encoding the pull (cast, or the sparse
update). Reported per mode: milliseconds of CPU per iteration for a worker and
for the shards, the wire bytes a worker pushes and pulls, and the seconds
those bytes save at a link rate against fp32. The figures are CPU time with
the machine's torch threads; the network is not involved.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from imerge.core.codec import PayloadReceiver
from imerge.core.compression import Payload, accumulate, encode_pull, make_compressor
from imerge.core.modes import CompressionSpec

MODES = ("none", "fp16", "bf16", "topk")


def gradient_blocks(model: str, partition_numel: int, seed: int = 0) -> list[torch.Tensor]:
    from imerge.workloads.models import build_model

    generator = torch.Generator().manual_seed(seed)
    total = sum(p.numel() for p in build_model(model, seed=0).parameters())
    flat = torch.randn(total, generator=generator) * 1e-3
    return list(flat.split(partition_numel))


def _receive(payload: Payload, numel: int) -> Payload:
    receiver = PayloadReceiver(numel, payload.dtype, payload.nnz if payload.sparse else -1, "bench")
    for part in payload.parts():
        receiver.feed(bytes(part))
    return receiver.finish()


def one_iteration(mode: str, blocks: list[torch.Tensor], compressors: list[Any], helds: list[Any],
                  params: list[torch.Tensor], workers: int) -> tuple[float, float, int, int]:
    """(worker CPU s, shards CPU s, push bytes, pull bytes) of one iteration (every worker sends the same)."""
    started = time.process_time()
    payloads = [compressor.compress(block)[0] for compressor, block in zip(compressors, blocks)]
    worker_s = time.process_time() - started
    started = time.process_time()
    pull_bytes = 0
    for payload, block, held, param in zip(payloads, blocks, helds, params):
        mean = torch.zeros(block.numel())
        for _ in range(workers):
            accumulate(mean, _receive(payload, block.numel()))
        param.add_(mean.div_(workers), alpha=-0.1)
        pulled = encode_pull(param, compressors[0].mode, held)
        pull_bytes += pulled.nbytes
    shard_s = time.process_time() - started
    return worker_s, shard_s, sum(p.nbytes for p in payloads), pull_bytes


@dataclasses.dataclass(frozen=True)
class ModeCost:
    """One compression mode's cost and gain per iteration."""

    worker_cpu_ms: float   # one worker compressing its gradient
    shards_cpu_ms: float   # the shards receiving every worker's payload and encoding the pull
    push_mb: float
    pull_mb: float
    link_s_saved: float    # the busier direction (a link carries both at once), against fp32


@dataclasses.dataclass(frozen=True)
class CompressionCostReport:
    model: str
    workers: int
    iters: int
    partition_mib: float
    ratio: float
    rate_mbit: float
    fp32_mb: float
    threads: int
    modes: dict[str, ModeCost]


def run_compression_cost(model: str = "resnet18", workers: int = 3, iters: int = 5, partition_mib: float = 1.0,
                         ratio: float = 0.01, rate_mbit: float = 1000.0) -> CompressionCostReport:
    blocks = gradient_blocks(model, int(partition_mib * (1 << 20)) // 4)
    fp32_bytes = sum(b.numel() for b in blocks) * 4
    results = {}
    for mode in MODES:
        block_mode = CompressionSpec(mode, ratio).block_mode(1 << 30)
        compressors = [make_compressor(block_mode, b.numel()) for b in blocks]
        params = [torch.zeros(b.numel()) for b in blocks]
        helds = [p.clone() if block_mode.sparse else None for p in params]
        runs = [one_iteration(mode, blocks, compressors, helds, params, workers) for _ in range(iters + 1)][1:]
        worker_s = statistics.median(r[0] for r in runs)
        shard_s = statistics.median(r[1] for r in runs)
        push, pull = runs[-1][2], runs[-1][3]
        results[mode] = ModeCost(worker_s * 1e3, shard_s * 1e3, push / 1e6, pull / 1e6,
                                 (fp32_bytes - max(push, pull)) * 8 / (rate_mbit * 1e6))
    return CompressionCostReport(model, workers, iters, partition_mib, ratio, rate_mbit, fp32_bytes / 1e6,
                                 torch.get_num_threads(), results)


def compression_markdown(report: CompressionCostReport) -> str:
    lines = [f"{report.model} ({report.fp32_mb:.1f} MB fp32), {report.workers} workers' payloads per "
             f"iteration, {report.partition_mib:g} MiB blocks, top-k ratio {report.ratio:g}, "
             f"{report.threads} torch threads; median of {report.iters} iterations; the shards step plain "
             f"SGD (with momentum or Adam every parameter changes, and a top-k pull is dense fp32 unless "
             f"--topk-pull-ratio bounds it). Link time saved: the busier direction at {report.rate_mbit:g} "
             f"Mbit/s, against fp32.", "",
             "| mode | worker CPU ms/it | shards CPU ms/it | push MB/it | pull MB/it | link s/it saved |",
             "|---|---|---|---|---|---|"]
    for mode, r in report.modes.items():
        lines.append(f"| {mode} | {r.worker_cpu_ms:.1f} | {r.shards_cpu_ms:.1f} | {r.push_mb:.2f} | "
                     f"{r.pull_mb:.2f} | {r.link_s_saved:.3f} |")
    return "\n".join(lines) + "\n"
