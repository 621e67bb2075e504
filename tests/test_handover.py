"""A blocking call's outcome handed from its thread to an asyncio future (``imerge.core.handover``), as the data
channels' threads hand theirs to the comm loop and the shard's loop."""
from __future__ import annotations

import asyncio
import threading

import pytest

from imerge.core.errors import Unavailable
from imerge.core.handover import hand_over, run_and_hand_over


def on_a_thread(loop: asyncio.AbstractEventLoop, done: asyncio.Future, function, *args) -> threading.Thread:
    thread = threading.Thread(target=run_and_hand_over, args=(loop, done, function, *args))
    thread.start()
    return thread


def test_the_result_and_the_error_of_a_call_on_a_thread_reach_the_awaiting_coroutine():
    async def go():
        loop = asyncio.get_running_loop()
        ran_on: list[int] = []
        result = loop.create_future()
        on_a_thread(loop, result, lambda x: ran_on.append(threading.get_ident()) or x * 2, 21).join()
        assert await asyncio.wait_for(result, 5) == 42 and ran_on[0] != threading.get_ident()

        def refuse() -> None:
            raise Unavailable("the shard is gone", address="ps0:1")

        failed = loop.create_future()
        on_a_thread(loop, failed, refuse).join()
        with pytest.raises(Unavailable, match="the shard is gone") as raised:
            await asyncio.wait_for(failed, 5)
        assert raised.value.address == "ps0:1"

    asyncio.run(go())


def test_a_call_cancelled_before_its_thread_takes_it_does_not_run_and_a_late_outcome_is_dropped():
    async def go():
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        ran: list[int] = []
        cancelled = loop.create_future()
        cancelled.cancel()
        on_a_thread(loop, cancelled, ran.append, 1).join()
        assert ran == []

        late = loop.create_future()
        release = threading.Event()
        thread = on_a_thread(loop, late, lambda: release.wait(5) and ran.append(2))
        late.cancel()  # while the call runs: it finishes, and its outcome finds the future done
        release.set()
        thread.join()
        await asyncio.sleep(0.05)  # the hand-over's callback runs, and must not raise InvalidStateError
        assert ran == [2] and late.cancelled() and errors == []

    asyncio.run(go())


def test_an_outcome_handed_to_a_closed_loop_is_dropped_without_an_error():
    loop = asyncio.new_event_loop()
    done = loop.create_future()
    loop.close()
    hand_over(loop, done, 1, False)  # the loop's owner is gone: nobody waits, the thread goes on
    assert not done.done()
