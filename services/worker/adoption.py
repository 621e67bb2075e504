"""Which optimizer the shards run: the script's, wherever it builds it before training.

A DDP script builds its optimizer after wrapping the model (the tutorial's
``model = DDP(model); optimizer = Adam(model.parameters())``) or before it
(nanoGPT's order), and may load a checkpoint's optimizer state into it before
the loop. Whatever it builds over the model's parameters before the job is
joined (the first forward, or the first call that needs the shards), IMerge
adopts: its class, arguments, parameter groups and loaded state go to the
shards. Anything else raises, naming the cause, because it would train
silently wrong: a second optimizer over the same parameters (one of the two
would do nothing, or step this worker alone with its local gradients), one
built once the job runs, or a spec passed beside a torch optimizer.

The watch is a wrapper of ``torch.optim.Optimizer.__init__`` (installed the
first time a model is distributed, :mod:`.torch_patches`) that tells every
watching model of a new optimizer over its parameters, and keeps every live
optimizer in a weak set;
the optimizers built before that are found among the live objects once, when
the wrapper is installed (a scan of every object: the process's first
``imerge.distribute`` pays it, the next ones read the set).
"""
from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any

import torch

from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

_watches: weakref.WeakSet["OptimizerWatch"] = weakref.WeakSet()
_live: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # every optimizer of the process, no proxy
_lock = threading.Lock()


def _param_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """(Empty for one whose __init__ has not run yet, as another thread builds it.)"""
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}


def _describe(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__name__} (lr {optimizer.param_groups[0].get('lr')})"


class OptimizerWatch:
    """The optimizers built over one model's parameters, and the one the shards run."""

    def __init__(self, module: torch.nn.Module, given: OptimizerSpec | torch.optim.Optimizer | None):
        self.param_ids = {id(p) for p in module.parameters()}
        self.given = given
        self.joined = False
        self._built: list[weakref.ref[torch.optim.Optimizer]] = []
        for optimizer in self._existing():
            self._add(optimizer)
        with _lock:
            _watches.add(self)

    def _existing(self) -> list[torch.optim.Optimizer]:
        """Live optimizers over these parameters, built before the watch started (garbage not yet collected
        excluded)."""
        found = self._over_these()
        if [o for o in found if o is not self.given]:
            del found
            gc.collect()  # an optimizer in a collectable cycle leaves the weak set
            found = self._over_these()
        return found

    def _over_these(self) -> list[torch.optim.Optimizer]:
        with _lock:
            live = list(_live)
        return [o for o in live if _param_ids(o) & self.param_ids]

    def _add(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.given or any(ref() is optimizer for ref in self._built):
            return
        if self.joined:
            raise UnsupportedUse(
                f"a {_describe(optimizer)} optimizer over the distributed model's parameters, built after the job "
                "started (its first forward, or model.optimizer, save, load or no_sync before it): the shards run "
                "the optimizer adopted then, so this one would step nothing or step this worker alone. Build the "
                "optimizer before the first forward, once")
        others = [ref() for ref in self._built if ref() is not None]
        if others or isinstance(self.given, (OptimizerSpec, torch.optim.Optimizer)):
            first = others[0] if others else self.given
            what = _describe(first) if isinstance(first, torch.optim.Optimizer) else f"the spec {first}"
            raise UnsupportedUse(
                f"a second optimizer over the distributed model's parameters: {_describe(optimizer)} beside {what}. "
                "The shards run one optimizer per model (with any parameter groups): the other would step nothing "
                "or step this worker alone; build one optimizer, with a parameter group per part")
        self._built.append(weakref.ref(optimizer))

    def built(self, optimizer: torch.optim.Optimizer) -> None:
        if _param_ids(optimizer) & self.param_ids:
            self._add(optimizer)

    def choose(self) -> OptimizerSpec | torch.optim.Optimizer | None:
        """The optimizer the shards will run (None: none was given or built); the watch now refuses new ones."""
        self.joined = True
        built = [ref() for ref in self._built if ref() is not None]
        return built[0] if built else self.given

    def stop(self) -> None:
        with _lock:
            _watches.discard(self)


def _is_proxy(optimizer: torch.optim.Optimizer) -> bool:
    return getattr(type(optimizer), "imerge_proxy", False)


_original_init: list[Any] = []  # torch's Optimizer.__init__, while the watch replaces it


def install() -> None:
    """Wrap ``torch.optim.Optimizer.__init__`` in the watch (once; see :mod:`.torch_patches`)."""
    original = torch.optim.Optimizer.__init__
    if getattr(original, "imerge_watch", False):
        return
    _original_init[:] = [original]

    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if _is_proxy(self):
            return
        with _lock:
            _live.add(self)
            watches = list(_watches)
        for watch in watches:
            watch.built(self)

    __init__.imerge_watch = True  # type: ignore[attr-defined]
    with _lock:  # the optimizers built before the wrapper: found once among every live object
        _live.update(o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer) and not _is_proxy(o))
        torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]  # the watch (see the module)


def remove() -> None:
    """torch's own ``Optimizer.__init__`` back (the optimizers built meanwhile stay in the live set)."""
    if _original_init:
        torch.optim.Optimizer.__init__ = _original_init.pop()  # type: ignore[method-assign]


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """The state a torch optimizer holds (loaded from a checkpoint, say), per parameter name and state name: flat
    per-element tensors and scalars, as ``imerge.save`` files hold it."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for param, values in optimizer.state.items():
        if id(param) not in names or not values:
            continue
        state[names[id(param)]] = {key: (value.detach().cpu().reshape(-1) if value.dim() > 0 else value.detach().cpu())
                                   for key, value in values.items() if isinstance(value, torch.Tensor)}
    return state


def take_loaded_state(chosen: OptimizerSpec | torch.optim.Optimizer, names: dict[int, str],
                      rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """The state of the script's own optimizer (a checkpoint's, loaded before the job started): worker 0's goes
    to the shards with the blocks, and the optimizer keeps none of it here (it lives on the shards; a frozen
    parameter's is never used)."""
    if not isinstance(chosen, torch.optim.Optimizer) or not chosen.state:
        return {}
    state = optimizer_state(chosen, names)
    chosen.state.clear()
    return state if rank == 0 else {}
