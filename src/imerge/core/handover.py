"""A blocking call's outcome handed from the thread that made it to an asyncio future on its loop.

One ``call_soon_threadsafe`` per outcome, where ``asyncio.wrap_future`` of a
``concurrent.futures.Future`` takes a condition, two chained done callbacks and
a state copy: the data channels' threads hand over one outcome per call or
payload, many per iteration, and wake the shard's waiting pulls and rows.

Pure: imports neither grpc nor redis.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


def settle(done: asyncio.Future[Any], outcome: Any, failed: bool) -> None:
    """On the loop: ``done`` takes ``outcome`` (an exception where ``failed``) unless it is done already (it was
    cancelled while the thread worked)."""
    if done.done():
        return
    if failed:
        done.set_exception(outcome)
    else:
        done.set_result(outcome)


def hand_over(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], outcome: Any, failed: bool) -> None:
    """From any thread: settle ``done`` on ``loop`` (nothing when the loop is closed: nobody waits on it)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle, done, outcome, failed)


def run_and_hand_over(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], function: Callable[..., Any],
                      *args: Any) -> None:
    """On a worker thread: ``function(*args)`` unless ``done`` was cancelled before it began (a stale read of that
    only runs a call whose outcome is then dropped), its result or exception handed to ``done``."""
    if done.cancelled():
        return
    try:
        outcome, failed = function(*args), False
    except BaseException as exc:  # noqa: BLE001 - the awaiting coroutine raises it
        outcome, failed = exc, True
    hand_over(loop, done, outcome, failed)
