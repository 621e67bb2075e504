"""The parameters as a training script sees them: every read waits for its block, every write is refused.

The shards step during backward, and the new parameters come back block by
block while the script goes on: a forward waits, module by module, only for
the blocks it needs. A DDP script expects more: whatever it reads after
backward and ``optimizer.step()`` (``state_dict()``, ``p.data``, an EMA update,
an evaluation, ``torch.save``) is the step's result. And a parameter may be
read before its own module runs (``F.linear(h, self.late.weight)`` early in a
forward), where no module hook waits for it.

So each parameter of a distributed model becomes a :class:`GuardedParameter`
(a subclass of ``nn.Parameter`` made per engine). Its ``__torch_function__``
sees every torch operation, property and method that takes it:

* while a sync of its block is in flight, an operation that reads its values
  first waits for that block (one set lookup when nothing is in flight;
  metadata such as ``shape`` never waits);
* ``.grad`` waits until its group's push is out (the local gradient is read
  by the wire until then);
* what would silently part the worker from the shards raises, naming the
  parameter: ``p.data = other`` (the shards keep training the old storage)
  and an in-place change outside the optimizer (the next pull would undo it).

The engine's own code runs under :func:`internal`, which none of this sees.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

import torch

from imerge.core.errors import UnsupportedUse

internal = torch._C.DisableTorchFunctionSubclass  # the engine's own operations on the parameters

# properties and methods that read metadata only: they never wait
_METADATA = {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda", "ndim",
             "is_sparse", "is_quantized", "is_meta", "names", "name", "_backward_hooks", "_post_accumulate_grad_hooks",
             "numel", "size", "dim", "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
             "element_size", "get_device", "nelement", "__hash__", "__len__", "_is_view", "is_shared", "is_pinned",
             "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "_version"}
_IN_PLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
_ALLOWED_IN_PLACE = {"requires_grad_", "share_memory_", "retain_grad"}


def _name(func: Any) -> tuple[str, str]:
    """(what the operation is called, "get"/"set"/"") for a function, method or property accessor."""
    name, descriptor = getattr(func, "__name__", ""), getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and descriptor is not None:
        return getattr(descriptor, "__name__", ""), name[2:5]
    return name, ""


class ParamGuard:
    """What the guarded parameters of one engine ask of it."""

    def __init__(self, names: dict[int, str], wait: Callable[[list[int]], None],
                 grad_ready: Callable[[int], None]):
        self.names = names              # id(param) -> its qualified name
        self.in_flight: set[int] = set()  # groups whose latest sync the training thread has not waited for yet
        self.wait = wait                # wait for the blocks holding these parameters
        self.grad_ready = grad_ready    # wait until the parameter's gradient slice is out on the wire
        self.assigning = False          # load_state_dict is writing the parameters (they go to the shards after)

    def refuse_write(self, param: Any, what: str) -> None:
        name = self.names.get(id(param), "?")
        raise UnsupportedUse(
            f"parameter {name}: {what} after imerge.distribute. The shards hold the parameters and the next pull "
            f"would undo the change on this worker alone; change parameters before imerge.distribute, or on "
            f"every worker through model.load_state_dict(...), whose values go to the shards")


class GuardedParameter(torch.nn.Parameter):
    """A parameter of a distributed model (see the module's docstring); ``_guard`` is set per engine."""

    _guard: ParamGuard

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name, accessor = _name(func)
        if name not in _METADATA:
            guard = _guard_of(args, kwargs)
            if guard is not None:
                _check(guard, name, accessor, args, kwargs)
        with internal():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Parameter:
        """A copy (an EMA model, say) is an ordinary parameter: it is not the job's."""
        with internal():
            copied = torch.nn.Parameter(self._settled().clone(memory_format=torch.preserve_format),
                                        self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Pickled (``torch.save(model)``) as an ordinary parameter of the step's values."""
        with internal():
            return torch.nn.Parameter(self._settled(), self.requires_grad).__reduce_ex__(protocol)

    def _settled(self) -> torch.Tensor:
        if self._guard.in_flight:
            self._guard.wait([id(self)])
        return self.data


def _guarded_in(value: Any) -> GuardedParameter | None:
    """The guarded parameter ``value`` is, or the first one of a list or tuple of tensors (a foreach op's)."""
    if isinstance(value, GuardedParameter):
        return value
    if isinstance(value, (list, tuple)):
        return next((item for item in value if isinstance(item, GuardedParameter)), None)
    return None


def _guard_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ParamGuard | None:
    for arg in (*args, *kwargs.values()):
        found = _guarded_in(arg)
        if found is not None:
            return found._guard
    return None


def _params_in(args: Iterable[Any], kwargs: dict[str, Any]) -> list[int]:
    found = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, GuardedParameter):
            found.append(id(arg))
        elif isinstance(arg, (list, tuple)):
            found.extend(id(item) for item in arg if isinstance(item, GuardedParameter))
    return found


def _check(guard: ParamGuard, name: str, accessor: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    param = args[0]
    if accessor == "set":
        if name == "data" and not (isinstance(args[1], torch.Tensor) and _same_storage(param, args[1])):
            guard.refuse_write(param, "p.data reassigned (or the model moved or cast with .to()/.half())")
        return
    if name == "grad" and accessor == "get":
        guard.grad_ready(id(param))
        return
    writes = (name in _IN_PLACE_DUNDER or (name.endswith("_") and not name.startswith("_")
                                           and name not in _ALLOWED_IN_PLACE))
    written = _guarded_in(param) if writes else None
    if written is None:
        written = _guarded_in(kwargs.get("out"))
    if written is not None and not guard.assigning:
        guard.refuse_write(written, f"an in-place {name}() on it")
    if guard.in_flight:
        guard.wait(_params_in(args, kwargs))


def _same_storage(param: torch.Tensor, value: torch.Tensor) -> bool:
    with internal():
        return (value.data_ptr() == param.data_ptr() and value.shape == param.shape
                and value.dtype == param.dtype and value.device == param.device)


def guard_params(params: list[torch.nn.Parameter], guard: ParamGuard) -> Callable[[], None]:
    """Make ``params`` guarded parameters of ``guard``; returns what makes them ordinary parameters again."""
    guarded = type("GuardedParameter", (GuardedParameter,), {"_guard": guard})
    originals = []
    for param in params:
        if type(param) is not torch.nn.Parameter:
            raise UnsupportedUse(f"parameter {guard.names.get(id(param), '?')} is a {type(param).__name__}, not a "
                                 "torch.nn.Parameter: IMerge trains plain parameters only")
        param.__class__ = guarded
        originals.append(weakref.ref(param))

    def release() -> None:
        for ref in originals:
            param = ref()
            if param is not None and type(param) is guarded:
                param.__class__ = torch.nn.Parameter

    return release
