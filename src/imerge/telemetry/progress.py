"""Progress events from a worker to ``imerge launch``.

The launcher hands worker 0 a pipe and names its file descriptor in
``IMERGE_PROGRESS_FD``; :func:`report` writes one JSON object per line to it.
Without the variable, events are logged instead. A training script's
``model.log_loss(loss)`` reports its iteration and loss here; a script may
also call ``imerge.progress.report(iteration=..., total=..., loss=...)`` (the
launcher's bar shows ``iteration`` of ``total``, the loss and ``seconds`` per
iteration; its summary, the last of them or a ``"summary"`` event's figures).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, TextIO

log = logging.getLogger(__name__)
PROGRESS_FD_ENV = "IMERGE_PROGRESS_FD"
_stream: TextIO | None = None


def _channel() -> TextIO | None:
    global _stream
    if _stream is None and os.environ.get(PROGRESS_FD_ENV, "").isdigit():
        try:
            _stream = os.fdopen(int(os.environ[PROGRESS_FD_ENV]), "w", buffering=1, closefd=False)
        except OSError as exc:
            log.warning("cannot open progress channel %s: %s", os.environ[PROGRESS_FD_ENV], exc)
            os.environ.pop(PROGRESS_FD_ENV, None)
    return _stream


def connected() -> bool:
    """Whether a launcher reads this process's progress (worker 0 under imerge launch)."""
    return _channel() is not None


def report(event: str = "iteration", **fields: Any) -> None:
    """Send one progress event (``iteration``, ``summary``, ...) to the launcher, or log it."""
    stream = _channel()
    record = {"event": event, **fields}
    if stream is None:
        log.info("%s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in record.items()))
        return
    try:
        stream.write(json.dumps(record) + "\n")
    except OSError:  # the launcher went away; keep training
        pass
