"""The store's formats are typed messages with one encoder and one decoder: every value round-trips, and a
malformed one is a StoreError naming the message, never a half-read value."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imerge.control.messages import (Member, ModuleState, PostedScalars, RankHolder, RankLeaseValue,
                                     RoundScalars)
from imerge.core.errors import StoreError

finite = st.floats(min_value=0, allow_nan=False, allow_infinity=False)


@given(shard=st.integers(0, 4096), sumsq=finite, found_inf=st.booleans())
def test_posted_scalars_round_trip_bit_for_bit(shard, sumsq, found_inf):
    posted = PostedScalars(shard, RoundScalars(sumsq, found_inf))
    back = PostedScalars.decode(posted.encode())
    assert back == posted and math.copysign(1, back.scalars.sumsq) == math.copysign(1, sumsq)


@given(data=st.binary(max_size=512))
def test_module_state_round_trips(data):
    assert ModuleState.decode(ModuleState(data).encode()) == ModuleState(data)


@given(host=st.from_regex(r"[a-z][a-z0-9.-]{0,30}", fullmatch=True), pid=st.integers(1, 2 ** 22),
       nonce=st.from_regex(r"[0-9a-f]{8}", fullmatch=True), beats=st.integers(0, 10 ** 9))
def test_a_rank_lease_round_trips_and_keeps_the_prefix_the_store_scripts_compare(host, pid, nonce, beats):
    value = RankLeaseValue(RankHolder(host, pid, nonce), beats)
    assert RankLeaseValue.decode(value.encode()) == value
    assert value.encode().startswith(value.holder.token + " ")


@pytest.mark.parametrize("kind, index", [("worker", 0), ("shard", 12)])
def test_a_member_is_its_kind_and_index(kind, index):
    member = Member(kind, index)
    assert Member.parse(str(member)) == member and str(member) == f"{kind} {index}"


@pytest.mark.parametrize("decode, text", [
    (PostedScalars.decode, '{"shard": 1, "sumsq": "1.0", "found_inf": false}'),
    (PostedScalars.decode, '{"shard": "1", "sumsq": 1.0, "found_inf": false}'),
    (PostedScalars.decode, '{"shard": 1, "sumsq": 1.0, "found_inf": 0}'),
    (PostedScalars.decode, '{"shard": 1}'),
    (PostedScalars.decode, "1 0.5 0"),  # the old "<shard> <sumsq> <found inf>" text
    (ModuleState.decode, '{"safetensors": "not base64!"}'),
    (ModuleState.decode, "bm90IGpzb24="),  # the old bare base64
    (RankLeaseValue.decode, "host:pid:nonce 3"),
    (RankLeaseValue.decode, "host:12:abc"),
    (RankLeaseValue.decode, "host:12 3"),
    (Member.parse, "worker"),
    (Member.parse, "coordinator 0"),
    (Member.parse, "worker -1"),
])
def test_a_malformed_value_is_a_store_error_naming_what_it_is(decode, text):
    with pytest.raises(StoreError, match="malformed"):
        decode(text)
