"""Compression on the wire: each mode equals one process that compresses every worker's gradient the same way."""
from __future__ import annotations

import math

import pytest
import torch

import imerge
from imerge.core.compression import TopKCompressor, densify, parse_mode
from imerge.core.modes import BlockMode, CompressionSpec, block_modes
from imerge.core.errors import ConfigError
from imerge.core.optim import OptimizerSpec
from imerge.workloads.models import build_model

WORKERS, SHARDS, STEPS, BATCH = 2, 2, 12, 16
SGD = OptimizerSpec("sgd", lr=0.05)
SGD_MOMENTUM = OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=5e-4)
ADAM = OptimizerSpec("adam", lr=1e-3)
CASES = {  # id: (optimizer, worker options)
    "fp16": (SGD_MOMENTUM, {"compression": "fp16"}),
    "bf16": (ADAM, {"compression": "bf16"}),
    "topk-sparse-pulls": (SGD, {"compression": "topk", "topk_ratio": 0.05}),
    "topk-momentum": (SGD_MOMENTUM, {"compression": "topk", "topk_ratio": 0.02}),
    "topk-bounded-pulls": (SGD_MOMENTUM, {"compression": "topk", "topk_ratio": 0.02, "topk_pull_ratio": 0.03}),
    "mixed": (SGD, {"compression": "mixed", "topk_ratio": 0.1, "mixed_threshold_kib": 2}),
}


def batches(seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(BATCH, 1, 8, 8, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
             for _ in range(WORKERS)] for _ in range(STEPS)]


def wire_bytes(engine, direction: str) -> tuple[float, float]:
    """(fp32 bytes, wire bytes) this worker's syncs moved in ``direction``."""
    totals = {"imerge_worker_uncompressed_bytes_total": 0.0, "imerge_worker_wire_bytes_total": 0.0}
    for family in engine.metrics.registry.collect():
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("direction") == direction:
                totals[sample.name] += sample.value
    return tuple(totals.values())


def distributed_run(cluster, spec, data, options):
    models = [build_model("digits-cnn", seed=0) for _ in range(WORKERS)]

    def body(rank: int):
        model = imerge.distribute(models[rank], spec, cluster.worker_config(rank, **options))
        engine = model.engine
        layout = sorted((engine.flat.range[pid][0], engine.names[pid], engine.flat.range[pid][1])
                        for pid in engine.flat.range)
        blocks = [(b.offset, b.numel, str(engine.comm.compression.mode(b.block_id))) for b in engine.plan.blocks]
        for step in data:
            x, y = step[rank]
            torch.nn.functional.cross_entropy(model(x), y).backward()
        model.close()
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        return params, layout, sorted(blocks), wire_bytes(engine, "push"), wire_bytes(engine, "pull")

    return cluster.run_workers(body)


class ReferenceCompression:
    """Written from the documented semantics, independently of the product's compressors."""

    def __init__(self, mode: str, numel: int):
        block = parse_mode(mode)
        self.kind = block.kind
        self.k = min(numel, max(1, math.ceil(block.ratio * numel)))
        self.pull_k = min(numel, max(1, math.ceil(block.pull_ratio * numel))) if block.pull_ratio else numel
        self.residual = torch.zeros(numel)
        self.held = None  # top-k: what the workers hold of the block

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as the shard will see it (dense fp32)."""
        if self.kind == "fp16":
            return grad.half().float()
        if self.kind == "bf16":
            return grad.bfloat16().float()
        if self.kind == "none":
            return grad
        corrected = grad + self.residual
        sent = torch.zeros_like(corrected)
        chosen = torch.topk(corrected.abs(), self.k).indices
        sent[chosen] = corrected[chosen]
        self.residual = corrected - sent
        return sent

    def received(self, params: torch.Tensor) -> torch.Tensor:
        """What a worker holds of the shard's parameters after a pull (or the first fetch)."""
        if self.kind in ("fp16", "bf16"):
            return params.half().float() if self.kind == "fp16" else params.bfloat16().float()
        if self.kind == "none":
            return params.clone()
        if self.held is None:  # the first fetch: every element
            self.held = params.clone()
        changed = (params != self.held).nonzero().reshape(-1)
        if changed.numel() > self.pull_k:  # the largest changes; the others are owed
            changed = torch.topk((params - self.held).abs(), self.pull_k).indices
        self.held[changed] = params[changed]
        return self.held.clone()


def reference_run(spec, data, layout, blocks) -> dict[str, torch.Tensor]:
    master = build_model("digits-cnn", seed=0)
    optimizer = spec.build(list(master.parameters()))
    named = dict(master.named_parameters())
    worker_model = build_model("digits-cnn", seed=0)
    worker_named = dict(worker_model.named_parameters())

    def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[name].detach().reshape(-1) for _, name, _ in layout])

    def unflat(vector: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: vector[offset:offset + numel].view_as(named[name]) for offset, name, numel in layout}

    compressors = [[ReferenceCompression(mode, numel) for _, numel, mode in blocks] for _ in range(WORKERS)]

    def received() -> torch.Tensor:
        master_flat = flat(named)
        return torch.cat([compressors[0][i].received(master_flat[offset:offset + numel])
                          for i, (offset, numel, _) in enumerate(blocks)])

    held = received()
    for step in data:
        with torch.no_grad():
            for name, value in unflat(held).items():
                worker_named[name].copy_(value)
        total = None
        for rank, (x, y) in enumerate(step):
            worker_model.zero_grad()
            torch.nn.functional.cross_entropy(worker_model(x), y).backward()
            grad = flat({n: p.grad for n, p in worker_named.items()})
            seen = torch.cat([compressors[rank][i](grad[offset:offset + numel])
                              for i, (offset, numel, _) in enumerate(blocks)])
            total = seen.clone() if total is None else total.add_(seen)
        for name, value in unflat(total.div_(WORKERS)).items():
            named[name].grad = value.clone()
        optimizer.step()
        held = received()
    return {name: value.clone() for name, value in unflat(held).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_mode_equals_one_process_that_compresses_the_same_way(cluster, case):
    spec, options = CASES[case]
    data = batches()
    results = distributed_run(cluster(WORKERS, SHARDS), spec, data, options)
    _, layout, blocks, (push_raw, push_wire), (pull_raw, pull_wire) = results[0]
    expected = reference_run(spec, data, layout, blocks)
    initial = dict(build_model("digits-cnn", seed=0).named_parameters())
    for worker, (params, *_) in enumerate(results):
        for name, value in expected.items():
            assert not torch.equal(value, initial[name]), f"{name} never trained"
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0,
                                       msg=lambda m: f"{case}, worker {worker}, {name}: {m}")
    modes = {parse_mode(mode).kind for *_, mode in blocks}
    assert push_raw > 0 and pull_raw > 0
    if case in ("fp16", "bf16"):
        assert modes == {case} and push_wire == push_raw / 2 and pull_wire == pull_raw / 2
    if case == "topk-sparse-pulls":  # plain SGD changes only what some worker sent: the pulls are sparse
        rounding = 8 * len(blocks) * STEPS  # a block's k is rounded up: at most one (index, value) pair more
        assert push_wire < 0.1 * push_raw + rounding and pull_wire < 0.5 * pull_raw, (push_wire, pull_wire)
    if case == "topk-bounded-pulls":  # at most 3% of each block as index + value: 6% of the fp32 bytes
        assert pull_wire <= 0.07 * pull_raw, (pull_wire, pull_raw)
    if case == "mixed":
        assert modes == {"fp16", "topk"}, blocks


def test_topk_error_feedback_sends_the_residual_later():
    compressor = TopKCompressor(BlockMode("topk", 0.25), 8)
    payload, _ = compressor.compress(torch.tensor([0.0, 5.0, 0.0, 1.0, 0.0, 0.0, -3.0, 0.5]))
    assert payload.indices.tolist() == [1, 6] and payload.values.tolist() == [5.0, -3.0]
    assert compressor.residual.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5]
    payload, _ = compressor.compress(torch.tensor([0.0, 0.1, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert payload.indices.tolist() == [3, 7] and payload.values.tolist() == [2.0, 0.5]  # 1 + 1, and 0.5 held over
    assert densify(payload, 8).tolist() == [0, 0, 0, 2.0, 0, 0, 0, 0.5]


def test_mixed_sends_small_groups_fp16_and_large_ones_topk():
    spec = CompressionSpec("mixed", ratio=0.01, threshold_bytes=1024)
    assert spec.block_mode(1000) == BlockMode("fp16") and spec.block_mode(1024) == BlockMode("topk", 0.01)
    assert CompressionSpec("bf16").block_mode(1 << 30) == BlockMode("bf16") and CompressionSpec().block_mode(8) == BlockMode()
    assert [str(parse_mode(name)) for name in ("", "fp16", "topk:0.01", "topk:0.01:0.5")] == \
        ["", "fp16", "topk:0.01", "topk:0.01:0.5"]  # the wire's names round-trip

    class Plan:  # the two attributes block_modes reads
        blocks = [type("B", (), {"block_id": i}) for i in "abc"]
        groups = [type("G", (), {"numel": 100, "blocks": (0,)}), type("G", (), {"numel": 1000, "blocks": (1, 2)})]

    assert {b: str(mode) for b, mode in block_modes(spec, Plan).items()} == \
        {"a": "fp16", "b": "topk:0.01", "c": "topk:0.01"}


def test_bad_compression_options_name_the_option():
    from imerge.worker.config import WorkerConfig

    for options, option in (({"compression": "zip"}, "compression"), ({"topk_ratio": 0.0}, "topk"),
                            ({"compression": "topk", "interleave_period": 2}, "interleave-period")):
        with pytest.raises(ConfigError, match=option):
            WorkerConfig(**options)


def test_a_grad_scaler_with_topk_is_refused_naming_the_cause(cluster):
    from imerge.core.errors import UnsupportedUse

    c = cluster(1, 1)
    model = imerge.distribute(build_model("digits-cnn", seed=0), SGD, c.worker_config(0, compression="topk"))
    try:
        with pytest.raises(UnsupportedUse, match="grad_scaler\\(\\) with --compression topk: the top-k residual"):
            model.grad_scaler()
    finally:
        model.abort()


def test_an_fp16_overflow_raises_naming_the_cause_instead_of_pushing_infinity(cluster):
    from imerge.core.errors import UnsupportedUse

    c = cluster(1, 1)
    model = imerge.distribute(torch.nn.Linear(4, 2), SGD, c.worker_config(0, compression="fp16"))
    try:
        model(torch.full((3, 4), 1e6)).sum().backward()  # weight gradient 3e6: beyond fp16's 65504
        with pytest.raises(UnsupportedUse, match=r"beyond fp16's range \(65504\) .* use bf16"):
            model.synchronize()
    finally:
        model.abort()


def test_bench_compression_reports_the_cpu_cost_and_the_bytes_of_every_mode():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "imerge", "bench", "compression", "--iters", "1", "--workers", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [float(cell) for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| mode")}
    assert set(rows) == {"none", "fp16", "bf16", "topk"}, result.stdout
    assert rows["fp16"][2] == pytest.approx(rows["none"][2] / 2, rel=1e-3)  # push MB: half of fp32
    assert rows["topk"][2] < 0.03 * rows["none"][2] and rows["none"][4] == 0.0  # 1% as index + value
    assert all(cpu >= 0 for row in rows.values() for cpu in row[:2])


def test_a_compression_spec_built_directly_names_the_option():
    for kwargs, option in (({"mode": "zip"}, "--compression"), ({"ratio": 2.0}, "--topk-ratio"),
                           ({"pull_ratio": -1.0}, "--topk-pull-ratio"), ({"threshold_bytes": -1}, "--mixed")):
        with pytest.raises(ConfigError, match=option):
            CompressionSpec(**kwargs)


def test_the_compression_cost_bench_measures_each_mode_on_the_shards_code_path():
    from imerge.bench.compression_cost import compression_markdown, run_compression_cost

    report = run_compression_cost(model="digits-cnn", workers=2, iters=1, partition_mib=0.01)
    modes = report.modes
    assert modes["fp16"].push_mb == modes["bf16"].push_mb == pytest.approx(modes["none"].push_mb / 2)
    assert modes["topk"].push_mb < modes["none"].push_mb * 0.02 * 2  # (index, value) pairs of 1%
    assert modes["none"].link_s_saved == 0 and modes["topk"].link_s_saved > modes["fp16"].link_s_saved
    assert all(f"| {mode} |" in compression_markdown(report) for mode in modes)
