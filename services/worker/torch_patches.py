"""Every change IMerge makes to torch and to the interpreter in a training script's process, in one place.

A DDP script calls torch's own functions on the model (``clip_grad_norm_``
after backward, ``torch.amp.GradScaler``, an optimizer built where it likes)
and simply ends. With the gradients on their way to the shards during
backward and the optimizer running there, each of these would do the wrong
thing silently; so IMerge changes what they do while models are distributed.
:func:`install` puts them all in place (once per process, by the first
``imerge.distribute``); :func:`remove` takes them all back (torch's own
functions again), once no model of the process is open. Each is torch's own
behaviour for whatever is not a distributed model.

Process-wide, installed and removed together:

* ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_norm`` and
  ``clip_grad_value_`` (:mod:`.guards`): after backward the model's gradients
  have left for the shards, so a call over its parameters has the shards clip
  the round and returns torch's result; the helpers torch's functions call
  refuse the model's gradients (a script that bound torch's function before
  would clip only this worker's ``.grad``).
* ``torch.optim.Optimizer.__init__`` (:mod:`.adoption`): the optimizer a
  script builds over the model's parameters, before or after distributing
  it, is the one the shards run; a second one, or one built once the job
  runs, is refused instead of doing nothing.
* ``torch.amp.GradScaler.scale``, ``unscale_`` and ``step`` (:mod:`.amp`):
  the loss scale travels with the pushes, the shards unscale and skip the
  round that overflowed, and every worker's scale follows the same sequence.
* ``sys.excepthook``, threading's exit hook and a fork hook
  (:mod:`.exiting`): a script that ends without ``close()`` (a DDP script has
  none) leaves the job with its last sync, an IMerge error ends the process
  with the exit code its supervisor reads, and a forked child (a DataLoader
  worker) never acts as the model's process. The exit and fork hooks cannot be
  unregistered: once removed they do nothing.

Per model, not process-wide: the model's parameters become a subclass of
``torch.nn.Parameter`` while it is open (:func:`.guarded.guard_params`, made
when it joins, undone when it closes or is disowned in a forked child), so
that a read or in-place write of a parameter whose new value is still on its
way waits for it.

IMerge's own processes (the launcher, ``imerge worker``, a shard) also mark
torch's optimizer methods as needing no ``torch._dynamo`` import
(:func:`imerge.core.optim.check_without_dynamo`), and step the optimizers they
build for a trial, and a shard its own, without torch.compile's wrapper
(:func:`imerge.core.optim_args.eager_step`); a training script's process never
does, since it may compile.
"""
from __future__ import annotations

import torch

from imerge.core.errors import IMergeError

from . import adoption, amp, exiting, guards

_PATCHES = (guards, adoption, amp, exiting)  # each with install() and remove(), both idempotent


def install() -> None:
    """Every patch in place (idempotent: the first call installs, later ones find them installed)."""
    for patch in _PATCHES:
        patch.install()


def remove() -> None:
    """torch's own functions and the interpreter's hooks back; IMergeError while a model of this process is open
    (its loop would silently lose what the patches do for it)."""
    still_open = exiting.open_models()
    if still_open:
        raise IMergeError(f"{len(still_open)} IMerge model(s) of this process are still open: close them before "
                          "removing IMerge's patches of torch")
    for patch in reversed(_PATCHES):
        patch.remove()


def installed() -> bool:
    """Whether the process-wide patches are in place."""
    return bool(getattr(torch.optim.Optimizer.__init__, "imerge_watch", False))
