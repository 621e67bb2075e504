"""Runs a DDP reference script (``python ddp_reference.py SCRIPT ARGS...``, under torchrun) and ends the process
without tearing the interpreter down.

Why: torch 2.13 stashes a Python object (the autograd engine's ``contextvars`` context) in the thread-local state
that every collective launched during ``backward()`` captures. Gloo's worker thread drops its last reference to
such a collective after the script has seen it complete, and that drop takes the GIL. When the script ends first
(a rank that saves nothing ends a few milliseconds after its last backward), the worker asks for the GIL while
the interpreter finalizes; Python 3.11 then ends the thread with ``pthread_exit``, whose unwinding through a
``noexcept`` destructor aborts the process ("terminate called without an active exception", SIGABRT). Measured
here: 12 of 120 runs of ``examples/gpt_ddp.py`` under torchrun died that way after writing every result. The
IMerge ports are not wrapped: their exit is part of what the tests check.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback

from imerge.bench.ddp_baseline import keep, leave


def run(script: str, arguments: list[str]) -> int:
    sys.argv = [script, *arguments]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:  # the script's globals (its model) are kept: leave() exits without freeing them
        keep(runpy.run_path(script, run_name="__main__"))
    except SystemExit as leaving:
        if leaving.code is None or isinstance(leaving.code, int):
            return leaving.code or 0
        print(leaving.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as Python would, then the same exit status
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    leave(run(sys.argv[1], sys.argv[2:]))
