"""The data plane: the C extension and its Python twin give the same bits, and a machine without a compiler
still installs and runs IMerge (on the Python path, saying so once)."""
from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from imerge.core import native
from imerge.core.errors import InvalidArgument
from imerge.core.native import RECV_CLOSED, RECV_DONE, RECV_PAUSED, RECV_TIMEOUT, data_plane

ROOT = Path(__file__).resolve().parents[1]
PLANES = ["native", "python"]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)


def torch_mean(rows: list[torch.Tensor], divisor: int) -> torch.Tensor:
    """What the shard computed before the data plane: torch's add in worker order, then its division."""
    out = torch.empty_like(rows[0])
    if len(rows) > 1:
        torch.add(rows[0], rows[1], out=out)
    else:
        out.copy_(rows[0])
    for row in rows[2:]:
        out.add_(row)
    return out.div_(divisor)


def test_the_extension_is_built_where_a_compiler_exists():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the Python data plane runs")
    assert native.native_available(), native.why_unavailable()
    assert data_plane("auto").name == "native"


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 7, 8])
def test_the_mean_of_the_rows_is_torchs_to_the_bit(plane, workers):
    generator = torch.Generator().manual_seed(workers)
    numel = 70_001  # not a multiple of any vector width or chunk
    rows = [torch.randn(numel, generator=generator) * 10.0 ** (3 * worker - 6) for worker in range(workers)]
    rows[0][:64] = torch.tensor([1e-40, -1e-41, 3e-45, 0.0, -0.0, 1e38, -1e38, 3.4e38] * 8)  # subnormals, huge
    out = torch.full((numel,), float("nan"))
    assert data_plane(plane).mean_rows(out, rows, workers) is True
    assert torch.equal(bits(out), bits(torch_mean(rows, workers)))


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_mean_that_is_not_finite_is_said_so(plane, bad):
    rows = [torch.ones(5000), torch.ones(5000), torch.ones(5000)]
    rows[2][4321] = bad
    out = torch.empty(5000)
    assert data_plane(plane).mean_rows(out, rows, 3) is False
    overflow = [torch.full((100,), 3e38), torch.full((100,), 3e38)]  # the sum overflows though each row is finite
    assert data_plane(plane).mean_rows(torch.empty(100), overflow, 2) is False


def test_rows_that_do_not_match_are_refused():
    with pytest.raises(InvalidArgument, match="contiguous float32"):
        data_plane("python").mean_rows(torch.empty(10), [torch.empty(11)], 1)
    with pytest.raises(InvalidArgument, match="contiguous float32"):
        data_plane("python").mean_rows(torch.empty(10), [torch.empty(10, dtype=torch.float64)], 1)
    with pytest.raises(InvalidArgument, match="not one of auto, native, python"):
        data_plane("fast")


def test_a_step_whose_new_parameters_would_overwrite_what_it_reads_is_refused():
    """The new parameters go to the parameters themselves or to memory apart from everything the step reads or
    keeps: half over the parameters, or over a row or the momentum buffer, the step would read back what it had
    just written (silently wrong bits)."""
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    plane, step = data_plane("native"), native.SgdStep(0.1, momentum=0.9)
    memory, rows, buffer = torch.zeros(3_000), [torch.ones(1_000), torch.ones(1_000)], torch.zeros(1_000)
    param = memory[:1_000]
    assert plane.sgd_step(param, rows, 2, step, buffer, param)  # in place
    assert plane.sgd_step(param, rows, 2, step, buffer, memory[1_000:2_000])  # apart
    for out, named in ((memory[500:1_500], "overlaps the parameters"), (rows[1], "a gradient row"),
                       (buffer, "the optimizer's state")):
        with pytest.raises(InvalidArgument, match=named):
            plane.sgd_step(param, rows, 2, step, buffer, out)
    state = {"exp_avg": torch.zeros(1_000), "exp_avg_sq": torch.zeros(1_000), "step": torch.tensor(1.0)}
    with pytest.raises(InvalidArgument, match="the optimizer's state"):
        native.adam_step(plane, param, rows, 2, native.AdamStep(0.1, 0.9, 0.999, 1e-8), state, state["exp_avg"])
    assert state["step"].item() == 1.0  # refused before anything changed


def receive(plane: str, sock: socket.socket, target: torch.Tensor, check: bool = True) -> tuple[int, bool, list[int]]:
    view = memoryview(target.numpy()).cast("B")
    received, finite, states = 0, True, []
    while received < len(view):
        count, part_finite, state = data_plane(plane).recv_into(sock, view, received, check)
        received, finite = received + count, finite and part_finite
        states.append(state)
        if state in (RECV_CLOSED, RECV_TIMEOUT) or (state == RECV_PAUSED and not count):  # not a sender's drip
            break
    return received, finite, states


def send_in_pieces(sock: socket.socket, data: bytes, sizes: list[int], pause_s: float = 0.0) -> threading.Thread:
    """Send ``data`` in pieces of the given sizes (cycled): elements split across the receiver's reads."""
    def run() -> None:
        offset, index = 0, 0
        while offset < len(data):
            size = sizes[index % len(sizes)]
            sock.sendall(data[offset:offset + size])
            offset, index = offset + size, index + 1
            if pause_s:
                time.sleep(pause_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("where", [None, 0, 1_000_000, 2_999_999])
def test_a_payload_lands_whole_and_a_nan_anywhere_is_seen(plane, where):
    payload = torch.randn(3_000_000)
    if where is not None:
        payload[where] = float("nan")
    left, right = socket.socketpair()
    right.settimeout(5)
    with left, right:
        sender = send_in_pieces(left, payload.numpy().tobytes(), [1 << 20, 3, 777_777, 5, 262_145])
        target = torch.empty_like(payload)
        received, finite, states = receive(plane, right, target)
        sender.join(10)
    assert received == payload.numel() * 4 and states[-1] == RECV_DONE
    assert torch.equal(bits(target), bits(payload))
    assert finite is (where is None)


@pytest.mark.parametrize("plane", PLANES)
def test_an_element_split_between_reads_is_checked_once_it_is_whole(plane):
    payload = torch.ones(1000)
    payload[1] = float("inf")  # bytes 4..7: sent as 6 and then the rest, so its two halves come in two reads
    left, right = socket.socketpair()
    right.settimeout(5)
    with left, right:
        sender = send_in_pieces(left, payload.numpy().tobytes(), [6, 4000], pause_s=0.2)
        received, finite, _ = receive(plane, right, torch.empty(1000))
        sender.join(10)
    assert received == 4000 and finite is False


@pytest.mark.parametrize("plane", PLANES)
def test_a_closed_or_silent_sender_is_reported_with_what_arrived(plane):
    left, right = socket.socketpair()
    right.settimeout(0.5)
    with right:
        left.sendall(b"\x00" * 1000)
        started = time.monotonic()
        received, _, states = receive(plane, right, torch.empty(1000))
        waited = time.monotonic() - started
        assert received == 1000 and states[-1] in (RECV_TIMEOUT, RECV_PAUSED)  # native: paused before the timeout
        assert waited < 2
        left.close()
        received, _, states = receive(plane, right, torch.empty(1000))
    assert received == 0 and states == [RECV_CLOSED]


def test_a_closed_socket_is_refused_as_its_own_methods_refuse_it():
    """A data-plane call on a socket already closed raises OSError (EBADF), as ``sock.recv`` would, which the
    callers' error handling takes for a failed connection (not a ValueError about a negative descriptor)."""
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    plane, (left, right) = data_plane("native"), socket.socketpair()
    left.close()
    right.close()
    for call in (lambda: plane.recv_into(right, memoryview(bytearray(8)), 0, False),
                 lambda: plane.recv_head(right, 16, 8, 64), lambda: plane.send_parts(right, [memoryview(b"x")])):
        with pytest.raises(OSError, match="the socket is closed") as info:
            call()
        assert info.value.errno == errno.EBADF


def test_the_native_receive_returns_within_its_budget_while_the_sender_drips():
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    left, right = socket.socketpair()
    right.settimeout(10)
    with left, right:
        target = memoryview(bytearray(4096))
        dripping = send_in_pieces(left, b"\x01" * 40, [1], pause_s=0.02)
        started = time.monotonic()
        count, _, state = data_plane("native").recv_into(right, target, 0, False, budget_s=0.2)
        took = time.monotonic() - started
        dripping.join(10)
    assert state == RECV_PAUSED and 0 < count < 40 and took < 1.0


def test_a_tls_socket_is_read_by_python(monkeypatch):
    """The native receive reads a plain socket's descriptor; anything else (a TLS socket) takes the Python
    path, which reads through its methods."""
    calls = []

    class Wrapped(socket.socket):  # as ssl.SSLSocket is: a subclass, whose bytes must pass its own recv
        def recv_into(self, buffer, nbytes=0, flags=0):  # noqa: ANN001, ANN201
            calls.append(len(buffer))
            return super().recv_into(buffer, nbytes, flags)

    left, right = socket.socketpair()
    wrapped = Wrapped(right.family, right.type, fileno=right.detach())
    with left, wrapped:
        left.sendall(b"\x00" * 400)
        received, _, _ = receive("auto", wrapped, torch.empty(100))
    assert received == 400 and calls


def test_without_a_compiler_the_install_succeeds_and_the_python_path_says_so(tmp_path):
    """A wheel built where the C compiler cannot be found holds no extension, installs, and runs on the Python
    data plane: ``auto`` logs one line, ``native`` refuses naming why."""
    source = tmp_path / "source"  # this checkout as a fresh clone has it: no build output, no extension built
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "runs", "*.so",
                                                                "__pycache__", "*.egg-info", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(source)],
                           env={**_env(), "CC": str(tmp_path / "no-compiler"), "TMPDIR": str(tmp_path)},
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stdout + build.stderr
    wheel = next((tmp_path / "wheel").glob("imerge-*.whl"))
    assert not [name for name in zipfile.ZipFile(wheel).namelist() if "_native" in name and name.endswith(".so")]
    # a fresh environment: a venv that sees this one's dependencies (torch, ...) but not its editable imerge
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "dependencies.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("import logging; logging.basicConfig(level=logging.INFO)\n"
             "import imerge, torch\n"
             "from imerge.core.native import data_plane, native_available\n"
             "assert imerge.__file__.startswith(%r), imerge.__file__\n"
             "assert not native_available()\n"
             "plane = data_plane('auto'); data_plane('auto')\n"
             "out = torch.empty(3); assert plane.mean_rows(out, [torch.ones(3), torch.ones(3)], 2)\n"
             "print('plane', plane.name, out.tolist())\n"
             "try:\n    data_plane('native')\nexcept Exception as exc:\n    print('refused', exc)\n") % str(site)
    run = subprocess.run([str(venv / "bin" / "python"), "-c", probe], env=_env(), capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "plane python [1.0, 1.0, 1.0]" in run.stdout
    assert "refused --data-plane native: imerge.core._native is not built" in run.stdout
    assert run.stderr.count("the native data plane is not available") == 1, run.stderr
    shard = subprocess.run([str(venv / "bin" / "python"), "-m", "imerge", "ps", "--no-register", "--metrics-port",
                            "-1", "--data-plane", "native"], env=_env(), capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert shard.returncode != 0 and "--data-plane native: imerge.core._native is not built" in shard.stderr, shard.stderr
    assert "Traceback" not in shard.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_") and k != "PYTHONPATH"}


SGD_VARIANTS = [dict(), dict(weight_decay=0.01), dict(momentum=0.9), dict(momentum=0.9, dampening=0.2),
                dict(momentum=0.9, nesterov=True, weight_decay=1e-3)]


OPTIMIZERS = [("sgd", hypers) for hypers in SGD_VARIANTS] + [
    ("adam", dict()), ("adam", dict(weight_decay=0.01)), ("adamw", dict(weight_decay=0.01)),
    ("adam", dict(betas=(0.3, 0.99), eps=1e-6))]


@pytest.mark.parametrize("name,hypers", OPTIMIZERS, ids=lambda v: v if isinstance(v, str) else ",".join(v) or "-")
def test_a_blocks_native_step_gives_torchs_bits(name, hypers):
    """A block's round on the native data plane (the mean, the optimizer step and the snapshot in native
    passes per piece) against the same block on the Python path (torch's add, div_ and the optimizer's
    step): equal bits over rounds of changing learning rates, with three workers and pieces of odd sizes
    (the optimizer's state too)."""
    from imerge.control.messages import RoundScalars  # noqa: F401 - the block's module needs the control plane
    from imerge.core.optim import OptimizerSpec, hyper_delta
    from imerge.ps.block import BlockMeta, BlockState
    from imerge.ps.metrics import ShardCounters, ShardMetrics
    from imerge.core.rounds import RoundOptions

    if not native.native_available():
        pytest.skip(native.why_unavailable())
    spec = OptimizerSpec(name, lr=0.05, **hypers)
    meta = BlockMeta("b", "float32", 10_007, 3, spec, (1, 4_000, 6_006))
    init = torch.randn(10_007, generator=torch.Generator().manual_seed(1))
    blocks = {plane: BlockState(meta, init.clone(), "d", data_plane(plane)) for plane in PLANES}
    metrics = ShardMetrics(0, ShardCounters(), 1e4)
    generator = torch.Generator().manual_seed(2)
    for round_ in range(5):
        rows = torch.randn(3, 10_007, generator=generator)
        options = RoundOptions(hypers=hyper_delta({"lr": 0.05 / (round_ + 1)}, {"lr": 0.05}))
        snapshots = {}
        for plane, block in blocks.items():
            block.grads.copy_(rows)
            snapshots[plane] = block.aggregate(metrics, options, set())
        assert torch.equal(bits(blocks["native"].flat), bits(blocks["python"].flat)), round_
        assert bytes(snapshots["native"].parts[0]) == bytes(snapshots["python"].parts[0])
    for native_piece, python_piece in zip(blocks["native"].pieces, blocks["python"].pieces):
        states = [blocks["native"].optimizer.state[native_piece], blocks["python"].optimizer.state[python_piece]]
        assert states[0].keys() == states[1].keys()
        for key, value in states[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, states[1][key]) and value.dtype == states[1][key].dtype, key


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 4099, 100_003])
def test_the_sum_of_squares_is_a_double_precision_sum_in_a_fixed_order(numel):
    """What clipping needs of a round's mean: one native pass, the float64 sum's value to rounding, the same bits
    every time (and whatever part of the machine's vector width the length fills)."""
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e3
    mine, torchs = data_plane("native").sum_of_squares(values), data_plane("python").sum_of_squares(values)
    assert mine == pytest.approx(torchs, rel=1e-12, abs=0.0)
    assert mine == data_plane("native").sum_of_squares(values.clone())
    with pytest.raises(InvalidArgument, match="not contiguous float32"):
        data_plane("native").sum_of_squares(values.double())


CLIPPED = {"norm": dict(max_norm=0.5), "value then norm": dict(clip_value=0.02, max_norm=0.5),
           "unscaled then norm": dict(loss_scale=1024.0, max_norm=0.5)}


@pytest.mark.parametrize("clipping", CLIPPED)
@pytest.mark.parametrize("name,hypers", OPTIMIZERS[2:], ids=lambda v: v if isinstance(v, str) else ",".join(v) or "-")
def test_a_clipped_rounds_native_step_gives_torchs_bits(monkeypatch, name, hypers, clipping):
    """A round whose mean is unscaled or clipped (the shards agree on the norm first) steps natively on that one
    row (divisor 1) from its second round on: the same bits as torch's step on the Python path, optimizer state
    included."""
    import imerge.ps.block as block_module
    from imerge.control.messages import RoundScalars
    from imerge.core.optim import OptimizerSpec, hyper_delta
    from imerge.core.rounds import RoundOptions
    from imerge.ps.block import BlockMeta, BlockState
    from imerge.ps.metrics import ShardCounters, ShardMetrics

    if not native.native_available():
        pytest.skip(native.why_unavailable())
    torch_steps = {"native": 0, "python": 0}
    plane_of: dict[int, str] = {}

    def counted(optimizer: torch.optim.Optimizer) -> None:
        torch_steps[plane_of[id(optimizer)]] += 1
        eager_step(optimizer)

    eager_step = block_module.eager_step
    monkeypatch.setattr(block_module, "eager_step", counted)
    spec = OptimizerSpec(name, lr=0.05, **hypers)
    meta = BlockMeta("b", "float32", 10_007, 3, spec, (1, 4_000, 6_006))
    init = torch.randn(10_007, generator=torch.Generator().manual_seed(1))
    blocks = {plane: BlockState(meta, init.clone(), "d", data_plane(plane)) for plane in PLANES}
    plane_of.update({id(block.optimizer): plane for plane, block in blocks.items()})
    metrics = ShardMetrics(0, ShardCounters(), 1e4)
    generator = torch.Generator().manual_seed(2)
    for round_ in range(4):
        rows = torch.randn(3, 10_007, generator=generator) * CLIPPED[clipping].get("loss_scale", 1.0)
        options = RoundOptions(hypers=hyper_delta({"lr": 0.05 / (round_ + 1)}, {"lr": 0.05}), **CLIPPED[clipping])
        snapshots, means = {}, {}
        for plane, block in blocks.items():
            block.grads.copy_(rows)
            means[plane], _ = block.average(metrics, options)
        total = RoundScalars(data_plane("python").sum_of_squares(means["python"]))  # one norm for both: the step's
        for plane, block in blocks.items():  # bits, not the sum's order (tested above), are what is compared here
            snapshots[plane] = block.step(metrics, means[plane], options, set(), total)
        assert torch.equal(bits(blocks["native"].flat), bits(blocks["python"].flat)), round_
        assert bytes(snapshots["native"].parts[0]) == bytes(snapshots["python"].parts[0])
    assert torch_steps == {"native": 1, "python": 4}  # torch's first step makes the state; native after it
    steps_timed = metrics.registry.get_sample_value("imerge_shard_optimizer_step_seconds_count", {"shard": "0"})
    assert steps_timed == 4 * len(blocks)  # one observation per round and block, whichever step took it
    for native_piece, python_piece in zip(blocks["native"].pieces, blocks["python"].pieces):
        states = [blocks["native"].optimizer.state[native_piece], blocks["python"].optimizer.state[python_piece]]
        for key, value in states[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, states[1][key]), key


def test_a_variant_whose_probe_disagrees_steps_with_torch(monkeypatch, caplog):
    """Where the probe of a variant finds other bits than torch's (another machine, another torch), the shard
    steps with torch: logged once, and the result is torch's."""
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    monkeypatch.setattr(native, "_VERIFIED", {})
    monkeypatch.setattr(native, "_probe_sgd", lambda plane, variant: False)
    step = native.SgdStep(0.1, momentum=0.5)
    with caplog.at_level("WARNING"):
        assert data_plane("native").fused_step(step) is False
        assert data_plane("native").fused_step(step) is False
    assert sum("differs from torch's" in r.getMessage() for r in caplog.records) == 1
    assert data_plane("python").fused_step(step) is False


def test_the_probe_passes_for_every_variant_here():
    if not native.native_available():
        pytest.skip(native.why_unavailable())
    for hypers in SGD_VARIANTS:
        step = native.SgdStep(0.1, **hypers)
        assert native._probe_sgd(data_plane("native"), step.variant), hypers
    for decay, decoupled, beta1 in [(0.0, False, 0.9), (0.01, False, 0.9), (0.01, True, 0.9), (0.0, False, 0.3)]:
        step = native.AdamStep(1e-3, beta1, 0.999, 1e-8, decay, decoupled)
        assert native._probe_adam(data_plane("native"), step.variant), step
