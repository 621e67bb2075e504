"""IMerge: parameter-server training for PyTorch that schedules its communication.

``imerge.distribute(model, ...)`` is the public entry point; see
:mod:`imerge.worker.api`. It is imported lazily so that ``imerge coordinator``
and other roles that do not train start without loading the worker.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["distribute", "DistributedModel", "WorkerConfig", "OptimizerSpec", "save", "load", "progress",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("distribute", "DistributedModel", "save", "load"):
        from imerge.worker import api
        return getattr(api, name)
    if name == "WorkerConfig":
        from imerge.worker.config import WorkerConfig
        return WorkerConfig
    if name == "progress":  # imerge.progress.report(iteration=..., total=..., loss=...): the launcher's bar
        from imerge.telemetry import progress
        return progress
    if name == "OptimizerSpec":
        from imerge.core.optim import OptimizerSpec
        return OptimizerSpec
    raise AttributeError(f"module 'imerge' has no attribute {name!r}")
