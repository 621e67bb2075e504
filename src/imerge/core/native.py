"""The data plane: the C extension ``imerge.core._native`` and its pure-Python twin, one interface.

The shard receives a push's payload from its socket straight into the worker's
gradient row with the finite check made on each chunk while it is in the
cache (:meth:`DataPlane.recv_into`), and sums the rows into the round's mean in
one pass (:meth:`DataPlane.mean_rows`), both with the GIL released. The C
extension is built by ``pip install`` where a C compiler exists; where it does
not, or ``--data-plane python`` asks, the same calls run in Python and torch
(one log line says which). Both give the same bits: float32 operations in
torch's order, each rounded once.

Pure: imports neither grpc nor redis.
"""
from __future__ import annotations

import dataclasses
import errno
import importlib
import logging
import math
import socket
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from imerge.core.compression import all_finite
from imerge.core.errors import InvalidArgument
from imerge.core.optim_args import eager_step

log = logging.getLogger(__name__)

_extension: ModuleType | None
try:
    _extension = importlib.import_module("imerge.core._native")
    _MISSING = ""
except ImportError as exc:  # no compiler at install time, or a build that failed: the Python path runs
    _extension = None
    _MISSING = str(exc)

CHOICES = ("auto", "native", "python")
RECV_DONE, RECV_CLOSED, RECV_TIMEOUT, RECV_PAUSED = 0, 1, 2, 3
MAX_FUSED_ROWS = 4096  # the most workers a native optimizer step sums (more: torch steps)
PAUSE_S = 0.25  # a native receive returns to Python at least this often (the rate checks)


def native_available() -> bool:
    return _extension is not None


def why_unavailable() -> str:
    """Why the C extension cannot be imported ("" when it can)."""
    return "" if _extension is not None else f"imerge.core._native is not built ({_MISSING})"


def native_socket(sock: socket.socket) -> tuple[int, int]:
    """(descriptor, timeout in ms, -1: none) of a socket for a native call; OSError (EBADF), as the socket's own
    methods raise, once it is closed."""
    fd = sock.fileno()
    if fd < 0:
        raise OSError(errno.EBADF, "the socket is closed")
    timeout = sock.gettimeout()
    return fd, -1 if timeout is None else max(int(math.ceil(timeout * 1000)), 0)


class DataPlane:
    """The byte-moving calls, native (``extension`` given) or Python."""

    def __init__(self, extension: ModuleType | None):
        self._native = extension

    @property
    def name(self) -> str:
        return "native" if self._native is not None else "python"

    def recv_into(self, sock: socket.socket, target: memoryview, start: int, check_finite: bool,
                  budget_s: float | None = PAUSE_S) -> tuple[int, bool, int]:
        """Receive bytes ``start:`` of ``target`` (a contiguous byte view of a tensor's memory; those before
        ``start`` came in earlier calls) from ``sock``; return (bytes received by this call, every float32
        element it completed is finite, state): RECV_DONE when all arrived, RECV_CLOSED when the peer closed
        first, RECV_TIMEOUT when nothing arrived for the socket's timeout, RECV_PAUSED when the call returned
        early (after ``budget_s``, None: never; the Python path after each ``recv``) so that the caller checks
        the sender's rate before it calls again. The native path needs a plain socket (a TLS socket's bytes must
        pass its decryption)."""
        if self._native is not None and type(sock) is socket.socket:
            fd, timeout_ms = native_socket(sock)
            count, finite, state = self._native.recv_into(fd, target, start, timeout_ms,
                                                          -1 if budget_s is None else max(int(budget_s * 1000), 1),
                                                          check_finite)
            return int(count), bool(finite), int(state)
        return _recv_into_python(sock, target, start, check_finite)

    def recv_head(self, sock: socket.socket, head_size: int, length_at: int, small: int) -> tuple[int, bytes] | None:
        """A frame's head from a plain socket in one call (see ``_native.c``): (state, the bytes received), or
        None where the data plane is Python's (the caller reads the head itself)."""
        if self._native is None:
            return None
        fd, timeout_ms = native_socket(sock)
        state, data = self._native.recv_head(fd, head_size, length_at, small, timeout_ms)
        return int(state), data

    def send_parts(self, sock: socket.socket, parts: Sequence[memoryview]) -> int | None:
        """Write ``parts`` to a plain socket in gathered writes, the GIL released throughout (see ``_native.c``),
        within the socket's timeout as its ``sendall`` would be (TimeoutError otherwise); the bytes written, or
        None where the data plane is Python's (the caller writes them itself)."""
        if self._native is None:
            return None
        fd, timeout_ms = native_socket(sock)
        sent, state = self._native.send_parts(fd, parts, timeout_ms)
        if state == RECV_TIMEOUT:
            raise TimeoutError(f"timed out: {sent} of {sum(len(part) for part in parts)} bytes written in "
                               f"{sock.gettimeout()}s")
        return int(sent)

    def mean_rows(self, out: torch.Tensor, rows: Sequence[torch.Tensor], divisor: int) -> bool:
        """``out`` = the rows added in their order, divided by ``divisor`` (all float32, contiguous, the same
        length); return whether every element of ``out`` is finite."""
        numel = out.numel()
        if any(row.numel() != numel or row.dtype != torch.float32 or not row.is_contiguous() for row in rows) or \
                out.dtype != torch.float32 or not out.is_contiguous() or not rows:
            raise InvalidArgument(f"mean_rows: {len(rows)} rows that are not contiguous float32 of {numel} elements")
        if self._native is not None:
            return bool(self._native.mean_rows(out.data_ptr(), [row.data_ptr() for row in rows], numel,
                                               float(divisor)))
        if len(rows) > 1:
            torch.add(rows[0], rows[1], out=out)
        else:
            out.copy_(rows[0])
        for row in rows[2:]:
            out.add_(row)
        out.div_(divisor)
        return all_finite(out)


    def sum_of_squares(self, values: torch.Tensor) -> float:
        """The sum of the squares of float32 ``values`` in double precision (a round's share of the global norm
        that clipping needs): one native pass (eight running sums in a fixed order), else torch's float64 sum."""
        if values.dtype != torch.float32 or not values.is_contiguous():
            raise InvalidArgument("sum_of_squares: values that are not contiguous float32")
        if self._native is not None:
            return float(self._native.sum_squares(values.data_ptr(), values.numel()))
        return float(values.double().square().sum())

    def fused_step(self, step: "SgdStep | AdamStep") -> bool:
        """Whether the native step may run ``step``'s variant here: the extension is built, and a probe of that
        variant (SGD: weight decay, momentum, dampening, Nesterov; Adam: weight decay, AdamW's) gave torch's
        bits on this machine (once per variant and process)."""
        if self._native is None:
            return False
        variant = step.variant
        if variant not in _VERIFIED:
            probe = _probe_adam if isinstance(step, AdamStep) else _probe_sgd
            _VERIFIED[variant] = probe(self, variant)  # type: ignore[arg-type]
            if not _VERIFIED[variant]:
                log.warning("the native optimizer step %s differs from torch's on this machine: the shards step "
                            "with torch (slower)", variant)
        return _VERIFIED[variant]

    def sgd_step(self, param: torch.Tensor, rows: Sequence[torch.Tensor], divisor: int, step: "SgdStep",
                 buffer: torch.Tensor | None, out: torch.Tensor) -> bool:
        """One pass: the rows' mean (as :meth:`mean_rows`), then ``step`` applied to ``param`` (and to the
        momentum ``buffer``) as torch.optim.SGD's single-tensor path does, the new parameters written into
        ``out`` (``param`` is only read; ``out`` may be ``param``); return whether the mean was finite. Only
        where :meth:`fused_step` said so."""
        if self._native is None:
            raise InvalidArgument("sgd_step needs the native data plane")
        _check_floats("sgd_step", param, out, [*rows, *(t for t in (buffer,) if t is not None)])
        return bool(self._native.sgd_step(
            param.data_ptr(), [row.data_ptr() for row in rows], param.numel(), float(divisor), -step.lr,
            step.weight_decay, step.momentum, 1.0 - step.dampening, step.nesterov,
            buffer.data_ptr() if buffer is not None else 0, out.data_ptr()))


@dataclasses.dataclass(frozen=True)
class SgdStep:
    """The hyperparameters of one step of ``torch.optim.SGD`` that the native step can take."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "SgdStep | None":
        """The step ``optimizer`` would take (its one parameter group), or None where it is not a plain
        single-tensor SGD step (maximize, differentiable, foreach, fused, a tensor learning rate)."""
        if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if group.get("maximize") or group.get("differentiable") or group.get("foreach") or group.get("fused"):
            return None
        values = [group.get(k, 0.0) for k in ("lr", "momentum", "dampening", "weight_decay")]
        if not all(type(v) in (float, int) for v in values):
            return None
        lr, momentum, dampening, weight_decay = (float(v) for v in values)
        return cls(lr, momentum, dampening, weight_decay, bool(group.get("nesterov")))

    @property
    def variant(self) -> tuple[bool, bool, bool, bool]:
        """What the probe must have checked: (weight decay, momentum, dampening, Nesterov)."""
        return self.weight_decay != 0, self.momentum != 0, self.dampening != 0, self.nesterov


_VERIFIED: dict[tuple[object, ...], bool] = {}


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """The hyperparameters of one step of ``torch.optim.Adam`` or ``AdamW`` that the native step can take."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    decoupled: bool = False  # AdamW's weight decay

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "AdamStep | None":
        """The step ``optimizer`` would take (its one group), or None where it is not a plain single-tensor
        Adam or AdamW step (amsgrad, maximize, capturable, differentiable, foreach, fused, tensor values)."""
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if any(group.get(flag) for flag in ("amsgrad", "maximize", "capturable", "differentiable", "foreach",
                                            "fused")):
            return None
        betas = group.get("betas")
        values = [group.get("lr"), *(betas if isinstance(betas, tuple) else (None, None)), group.get("eps"),
                  group.get("weight_decay", 0.0)]
        if not all(type(v) in (float, int) for v in values):
            return None
        lr, beta1, beta2, eps, weight_decay = (float(v) for v in values)
        decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
        return cls(lr, beta1, beta2, eps, weight_decay, decoupled)

    @property
    def variant(self) -> tuple[str, bool, bool, bool]:
        return "adam", self.weight_decay != 0, self.decoupled, abs(1 - self.beta1) < 0.5


def adam_step(plane: DataPlane, param: torch.Tensor, rows: Sequence[torch.Tensor], divisor: int, step: AdamStep,
              state: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
    """One Adam step of ``param`` on the rows' mean, as torch.optim.Adam's single-tensor path makes it (its
    ``step``, ``exp_avg`` and ``exp_avg_sq`` in ``state``, made by torch's first step): the moments in a
    native pass, torch's square root, the update in a second pass, the new parameters written into ``out``
    (``param`` is only read; ``out`` may be ``param``). Returns whether the mean was finite. Only where
    :meth:`DataPlane.fused_step` said so."""
    native = plane._native
    if native is None:
        raise InvalidArgument("adam_step needs the native data plane")
    exp_avg, exp_avg_sq, count = state["exp_avg"], state["exp_avg_sq"], state["step"]
    _check_floats("adam_step", param, out, [*rows, exp_avg, exp_avg_sq])
    count += 1
    decay_mul = 1 - step.lr * step.weight_decay if step.decoupled and step.weight_decay else 0.0
    finite = bool(native.adam_moments(param.data_ptr(), [row.data_ptr() for row in rows], param.numel(),
                                      float(divisor), 0.0 if step.decoupled else step.weight_decay, decay_mul,
                                      1 - step.beta1, step.beta2, 1 - step.beta2, exp_avg.data_ptr(),
                                      exp_avg_sq.data_ptr(), out.data_ptr()))
    number = count.item()
    bias_correction1, bias_correction2 = 1 - step.beta1 ** number, 1 - step.beta2 ** number
    root = exp_avg_sq.sqrt()
    decayed = out if decay_mul else param  # AdamW's moments pass wrote the decayed parameters into out
    native.adam_update(decayed.data_ptr(), exp_avg.data_ptr(), root.data_ptr(), param.numel(),
                       bias_correction2 ** 0.5, step.eps, -(step.lr / bias_correction1), out.data_ptr())
    return finite


def _check_floats(what: str, param: torch.Tensor, out: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
    """Every tensor a contiguous float32 run of ``param``'s length; ``out`` (where the new parameters go)
    ``param`` itself or apart from it, and apart from every other tensor the step reads or keeps (the rows,
    the optimizer's state): written over one of them, the step would go on from bytes it had just replaced."""
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != param.numel()
           for t in [param, out, *others]):
        raise InvalidArgument(f"{what}: tensors that are not contiguous float32 of {param.numel()} elements")
    nbytes = param.numel() * param.element_size()

    def overlaps(tensor: torch.Tensor) -> bool:
        return out.data_ptr() < tensor.data_ptr() + nbytes and tensor.data_ptr() < out.data_ptr() + nbytes

    if out.data_ptr() != param.data_ptr() and overlaps(param):
        raise InvalidArgument(f"{what}: the new parameters' place overlaps the parameters without being them")
    if nbytes and any(overlaps(tensor) for tensor in others):
        raise InvalidArgument(f"{what}: the new parameters' place overlaps a gradient row or the optimizer's "
                              "state")


def _probe_sgd(plane: DataPlane, variant: tuple[bool, bool, bool, bool]) -> bool:
    """Whether the native step gives torch.optim.SGD's bits for ``variant`` (:func:`_probe`)."""
    decay, momentum, dampening, nesterov = variant
    step = SgdStep(0.0137, 0.9 if momentum else 0.0, 0.3 if dampening else 0.0, 0.011 if decay else 0.0,
                   nesterov and momentum)
    theirs = torch.nn.Parameter(torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(46)))
    optimizer = torch.optim.SGD([theirs], lr=step.lr, momentum=step.momentum, dampening=step.dampening,
                                weight_decay=step.weight_decay, nesterov=step.nesterov)
    return _probe(optimizer, theirs, ("momentum_buffer",) if momentum else (),
                  lambda ours, rows, state, out: plane.sgd_step(ours, rows, len(rows), step,
                                                                state.get("momentum_buffer"), out))


def _probe_adam(plane: DataPlane, variant: tuple[str, bool, bool, bool]) -> bool:
    """Whether the native step gives torch.optim.Adam's (AdamW's) bits for ``variant`` (:func:`_probe`)."""
    _, decay, decoupled, small_weight = variant
    step = AdamStep(0.0031, 0.9 if small_weight else 0.3, 0.997, 1e-7, 0.013 if decay else 0.0, decoupled)
    theirs = torch.nn.Parameter(torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(47)))
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        [theirs], lr=step.lr, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay)
    return _probe(optimizer, theirs, ("exp_avg", "exp_avg_sq", "step"),
                  lambda ours, rows, state, out: adam_step(plane, ours, rows, len(rows), step, state, out))


NativeStep = Callable[[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor], object]
PROBE_NUMEL = 4099  # every vector width's tail


def _probe(optimizer: torch.optim.Optimizer, theirs: torch.nn.Parameter, names: tuple[str, ...],
           native_step: NativeStep, steps: int = 4) -> bool:
    """Torch's first step makes the optimizer's state; then ``steps - 1`` steps on the mean of 3 random rows,
    by torch and by ``native_step(params, rows, state, out)`` on copies, compared bit for bit: the new
    parameters and the state ``names``. The steps but the last write into a second buffer (the parameters
    they read must stay as they were), the last in place."""
    generator = torch.Generator().manual_seed(48)
    ours, state, mean, workers = theirs.detach().clone(), {}, torch.empty(theirs.numel()), 3
    for index in range(steps):
        rows = [torch.randn(theirs.numel(), generator=generator) * 10.0 ** (w - 1) for w in range(workers)]
        DataPlane(None).mean_rows(mean, rows, workers)
        theirs.grad = mean.clone()
        eager_step(optimizer)
        kept = optimizer.state[theirs]
        if index == 0:
            ours.copy_(theirs.detach())
            state = {name: value.clone() for name, value in kept.items() if isinstance(value, torch.Tensor)}
            continue
        before, out = ours.clone(), ours if index == steps - 1 else torch.empty(theirs.numel())
        native_step(ours, rows, state, out)
        if not (_same(out, theirs.detach()) and (out is ours or _same(ours, before)) and
                all(name in kept and _same(state[name], kept[name]) for name in names)):
            return False
        ours = out
    return True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _recv_into_python(sock: socket.socket, target: memoryview, start: int,
                      check_finite: bool) -> tuple[int, bool, int]:
    """One ``recv`` (the GIL released while it waits), then the finite check of the elements it completed."""
    if start >= len(target):
        return 0, True, RECV_DONE
    try:
        count = sock.recv_into(target[start:])
    except TimeoutError:
        return 0, True, RECV_TIMEOUT
    if count == 0:
        return 0, True, RECV_CLOSED
    end = start + count
    first, last = start - start % 4, end - end % 4
    finite = not check_finite or last <= first or \
        all_finite(torch.frombuffer(target[first:last], dtype=torch.float32))
    return count, finite, RECV_DONE if end == len(target) else RECV_PAUSED


_chosen: dict[str, DataPlane] = {}


def data_plane(choice: str = "auto") -> DataPlane:
    """The data plane ``choice`` names: ``native`` (the C extension; InvalidArgument saying why where it is not
    built), ``python``, or ``auto`` (native where built; one log line when not)."""
    if choice not in CHOICES:
        raise InvalidArgument(f"data plane {choice!r} is not one of {', '.join(CHOICES)}")
    if choice in _chosen:
        return _chosen[choice]
    if choice == "native" and _extension is None:
        raise InvalidArgument(f"--data-plane native: {why_unavailable()}: reinstall with a C compiler "
                              "(gcc or clang) on PATH, or use --data-plane auto")
    if choice == "auto" and _extension is None:
        log.warning("the native data plane is not available (%s): bytes are received and summed in Python "
                    "(slower; install a C compiler and reinstall imerge)", why_unavailable())
    plane = DataPlane(_extension if choice != "python" else None)
    _chosen[choice] = plane
    return plane
