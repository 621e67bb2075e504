"""Child processes that never outlive their parent and stop as a group."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from typing import IO, Any

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGKILL to the child when its parent dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: best effort only
        pass


def spawn(argv: list[str], *, env: dict[str, str] | None = None, stdout: int | IO[Any] | None = None,
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session (its own process group) bound to our lifetime."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.STDOUT if stdout is not None else None,
                            start_new_session=True, pass_fds=pass_fds, preexec_fn=die_with_parent)


def signal_group(process: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(processes: list[subprocess.Popen[Any]], grace_s: float) -> list[int]:
    """SIGTERM every process group at once (they drain in parallel), then :func:`stop` each; the exit codes."""
    for process in processes:
        if process.poll() is None:
            signal_group(process, signal.SIGTERM)
    return [stop(process, grace_s) for process in processes]


def stop(process: subprocess.Popen[Any], grace_s: float) -> int:
    """SIGTERM the child's process group, SIGKILL it after ``grace_s``; return the exit code."""
    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait(5)
    signal_group(process, signal.SIGKILL)  # anything the child left behind in its group
    return process.returncode
