"""The slot policies (off, ack, fixed) against a fake of the store's two flag methods: no Redis, no gRPC.

The real store's flags (Lua leases, wake lists, fencing tokens) are tested against a real Redis server in
test_failures.py, test_scheduler.py and test_fencing.py; here only the policies' decisions are.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pytest

from imerge.core.slots import AckSlots, FixedSlots, NoSlots, make_slots


@dataclasses.dataclass
class Grant:
    contended: bool
    fence: int


class FakeFlags:
    """Records the calls a policy makes; grants every flag with growing fencing tokens."""

    def __init__(self, release_ok: bool = True):
        self.calls: list[tuple[str, object, str, float]] = []
        self.release_ok = release_ok

    def acquire_flag(self, flag, token, lease_s, timeout_s, generation):
        self.calls.append(("acquire", flag, token, time.monotonic()))
        return Grant(contended=len(self.calls) > 1, fence=len(self.calls))

    def release_flag(self, flag, token):
        self.calls.append(("release", flag, token, time.monotonic()))
        return self.release_ok


OPTIONS = dict(owner="w3", lease_s=5.0, timeout_s=10.0, generation=2)


def held(policy, flag, nbytes, body_s=0.0, fail=False):
    """Hold ``flag`` around a body that takes ``body_s``; return the slot and when the body ran."""
    ran = {}

    async def run():
        async with policy.hold(flag, nbytes) as slot:
            ran["start"] = time.monotonic()
            await asyncio.sleep(body_s)
            ran["end"] = time.monotonic()
            if fail:
                raise RuntimeError("push failed")
        return slot

    return asyncio.run(run()), ran


def test_off_takes_no_flag_and_sends_no_fencing_token():
    slot, _ = held(NoSlots(), "1:0", 1000)
    assert slot.fence == 0 and not slot.contended and slot.waited_s == 0
    assert make_slots("off", FakeFlags(), **OPTIONS).holds_flags is False


def test_ack_holds_the_flag_exactly_around_the_push_and_passes_its_token():
    flags = FakeFlags()
    slot, ran = held(AckSlots(flags, **OPTIONS), "1:4", 1000, body_s=0.05)
    (acquire, flag, token, taken), (release, flag_again, token_again, freed) = flags.calls
    assert (acquire, release, flag, flag_again) == ("acquire", "release", "1:4", "1:4")
    assert token == token_again and token.startswith("w3:")  # the holder's own token releases it
    assert taken <= ran["start"] and ran["end"] <= freed  # held from before the push until after its ack
    assert slot.fence == 1 and slot.held_s >= 0.05


def test_ack_releases_the_flag_when_the_push_fails():
    flags = FakeFlags()
    with pytest.raises(RuntimeError, match="push failed"):
        held(AckSlots(flags, **OPTIONS), "1:0", 1000, fail=True)
    assert [call[0] for call in flags.calls] == ["acquire", "release"]


def test_a_release_after_the_lease_passed_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="imerge.core.slots"):
        held(AckSlots(FakeFlags(release_ok=False), **OPTIONS), "1:2", 1000)
    assert "slot flag 1:2 had passed to another holder" in caplog.text


def test_fixed_holds_for_the_slot_time_even_when_the_push_ends_earlier():
    flags = FakeFlags()
    policy = make_slots("fixed", flags, bandwidth_mbps=8.0, **OPTIONS)  # 1 MB/s
    assert isinstance(policy, FixedSlots) and policy.clock.slot_time(200_000) == pytest.approx(0.2)
    slot, ran = held(policy, "1:0", 200_000, body_s=0.01)
    freed = flags.calls[1][3]
    assert freed - flags.calls[0][3] >= 0.2 - 0.01  # the slot time, not the 10 ms push
    assert ran["end"] - ran["start"] < 0.2


def test_fixed_measures_the_bandwidth_from_the_pushes_when_none_is_given():
    policy = make_slots("fixed", FakeFlags(), **OPTIONS)
    assert policy.clock.slot_time(1_000_000) == 0.0  # nothing measured yet: no wait beyond the push
    policy.observe(1_000_000, 1.0)
    assert policy.clock.bandwidth_bps == 1_000_000
    policy.observe(1_000_000, 0.5)
    assert policy.clock.bandwidth_bps == pytest.approx(0.8 * 1e6 + 0.2 * 2e6)
    given = make_slots("fixed", FakeFlags(), bandwidth_mbps=8.0, **OPTIONS)
    given.observe(1_000_000, 0.1)
    assert given.clock.bandwidth_bps == 1e6  # a given bandwidth is kept


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown slot policy 'random'"):
        make_slots("random", FakeFlags(), **OPTIONS)


def test_slot_width_auto_and_slots_that_guard_nothing():
    from imerge.core.slots import effective_policy, resolve_width

    assert resolve_width("shard", 0, 3) == 3 and resolve_width("group", 0, 3) == 1
    assert resolve_width("shard", 2, 3) == 2 and resolve_width("group", 2, 3) == 2
    assert effective_policy("ack", resolve_width("shard", 0, 3), 3) == "off"   # B2: 3 workers, 3 shards
    assert effective_policy("ack", resolve_width("shard", 0, 1), 6) == "ack"   # B3: 6 workers, 1 shard
    assert effective_policy("fixed", 2, 4) == "fixed" and effective_policy("fixed", 4, 4) == "off"
