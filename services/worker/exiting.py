"""How a training script that uses IMerge ends: every model leaves its job, and the exit code says why.

* At interpreter exit, a model the script did not close leaves its job: with
  its last sync and done mark after a normal end (a DDP script has no close()),
  at once (abort) after an uncaught exception.
* An uncaught IMerge error ends the process with the code its supervisor reads:
  EXIT_REJOIN (restart it and it rejoins) or EXIT_FATAL.
* Every IMerge error that reaches the script passes one choke point
  (:func:`reaching_the_script`, on each entry point of the training thread):
  the model reports it to the coordinator before the script sees it (a
  recoverable one starts a recovery, a fatal one ends the job naming it) and
  keeps a fatal one, so whatever the script does with the exception (catch it
  and ``sys.exit(1)``, swallow it, end normally) the worker never marks itself
  done, and the process ends with EXIT_FATAL, which no supervisor restarts.
* A process forked from the model's (a DataLoader worker, ``multiprocessing``,
  ``os.fork``) is never the model's process: the fork disowns every model in
  the child, so neither hook touches the job there (a forked child runs
  threading's exit hooks when it ends: ``multiprocessing`` calls
  ``threading._shutdown``), and a disowned model refuses any use.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from imerge.core.errors import EXIT_FATAL, EXIT_REJOIN, IMergeError

if TYPE_CHECKING:
    from .api import DistributedModel

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
NO_THREADS_AT_EXIT = (" (Python 3.12.0 to 3.12.2 start no thread once the interpreter exits: call model.close() at the "
                      "end of the script, or use Python 3.12.3 or later)")

live: "weakref.WeakSet[DistributedModel]" = weakref.WeakSet()  # every model not closed yet, for the exit hook
uncaught: list[BaseException] = []  # the exception ending the script, if one does
_installed_in: list[int] = []  # the pid of the process whose models the hooks serve (empty: not installed)
_previous_excepthook: list[Callable[..., Any]] = []  # the excepthook ours wraps, while ours is installed
_registered: list[bool] = []  # the exit and fork hooks are registered (once per process: neither can be undone)


def _exit_code(error: BaseException) -> int:
    if isinstance(error, IMergeError):
        return EXIT_REJOIN if error.recoverable else EXIT_FATAL
    return 1


def leave_at_exit() -> None:
    """At interpreter exit, every model the script did not close leaves the job: with the last sync and a done mark
    where the script ended normally (a DDP script has no close() to call), at once where an exception ended it.
    The comm thread is stopped here, before the interpreter tears down under it. In a forked child it does
    nothing: the models are the parent's."""
    if not _installed_in or _installed_in[0] != os.getpid():
        return
    for model in open_models():
        if model.fatal is not None:
            model.abort()
            log.error("worker %d ends with exit code %d: the job failed with %s: %s (the script went on after it; "
                      "the job is not restarted)", model.config.rank, EXIT_FATAL, type(model.fatal).__name__,
                      model.fatal)
            _exit_now(EXIT_FATAL)
        if uncaught:
            model.abort()
            continue
        try:
            model.close()
        except BaseException as exc:  # noqa: BLE001 - the process must say it failed, not exit 0
            log.error("worker %d could not leave the job at exit: %s: %s%s", model.config.rank, type(exc).__name__,
                      exc, NO_THREADS_AT_EXIT if "new thread at interpreter shutdown" in str(exc) else "")
            _exit_now(_exit_code(exc))


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reaching_the_script(function: F) -> F:
    """An entry point of IMerge on the training thread (a call of the script, or a hook torch runs for it): an IMerge
    error that leaves it is reported by the models this thread trains before the script sees it."""

    @functools.wraps(function)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except IMergeError as exc:
            refused(exc)
            raise

    return entry  # type: ignore[return-value]


def open_models() -> list[DistributedModel]:
    """The models of this process not closed yet."""
    return [model for model in list(live) if not model._closed]


def trained_here() -> list[DistributedModel]:
    """The models this thread trains (the script's one, usually), in this process."""
    if _installed_in != [os.getpid()]:
        return []
    thread = threading.get_ident()
    return [model for model in open_models() if model.training_thread == thread]


def refused(error: IMergeError) -> None:
    """``error`` reaches the script: each model trained from this thread reports it (once) and keeps a fatal one."""
    if _installed_in != [os.getpid()]:
        return
    thread = threading.get_ident()
    for model in list(live):
        if model.training_thread == thread:
            model.refused(error)


def _exit_codes(previous: Callable[..., Any]) -> Callable[..., Any]:
    """An excepthook that ends a training script killed by an IMerge error with the code its supervisor reads:
    EXIT_REJOIN (recoverable: restart it and it rejoins) or EXIT_FATAL (restarting would fail the same way); any
    uncaught exception makes the exit hook abort (not close) the models still open."""

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        uncaught.append(value)
        previous(kind, value, traceback)
        if isinstance(value, IMergeError) and _installed_in == [os.getpid()]:
            _exit_now(_exit_code(value))

    hook.imerge = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Install the excepthook, the exit hook and the fork hook (see :mod:`.torch_patches`). The exit hook is one
    of threading's (as concurrent.futures' is): it runs when the main thread ends, before the interpreter joins its
    threads, where Python 3.12.3 and later (CPython gh-113964) still start the threads that leaving the job
    takes; from an atexit hook, Python 3.12 and later refuse them. Neither it nor the fork hook can be taken back:
    they are registered once per process and do nothing while the hooks are removed."""
    if not getattr(sys.excepthook, "imerge", False):
        _previous_excepthook[:] = [sys.excepthook]
        sys.excepthook = _exit_codes(sys.excepthook)
    if not _registered:
        getattr(threading, "_register_atexit", atexit.register)(leave_at_exit)
        os.register_at_fork(after_in_child=_disown_in_child)
        _registered.append(True)
    _installed_in[:] = [os.getpid()]


def remove() -> None:
    """The excepthook the process had before; the exit and fork hooks do nothing from now on."""
    if getattr(sys.excepthook, "imerge", False) and _previous_excepthook:
        sys.excepthook = _previous_excepthook.pop()
    _installed_in.clear()


def _disown_in_child() -> None:
    """In a forked child: the parent's models are not this process's (no exit hook, no done mark, no lease
    release, no connection use); each refuses any use, naming why."""
    for model in list(live):
        model._disown()
    live.clear()
    uncaught.clear()


def track(model: DistributedModel) -> None:
    """``model`` leaves its job at exit unless the script closes it first."""
    live.add(model)
