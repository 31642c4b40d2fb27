"""The hand-written wire coding of Place and Release equals what the generated (betterproto) classes
read and write."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.gen.computedomain.placement import v1 as pp
from services.advisor.grpc_service import to_request, to_response
from services.advisor.model import Decision, InvalidRequest, PolicyName, Reason, ReservationInfo, Segment
from services.advisor.wire import (
    decode_place_request,
    decode_release_request,
    encode_place_response,
    encode_release_response,
)

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
text = st.text(max_size=12)


@st.composite
def place_requests(draw: st.DrawFn) -> pp.PlaceRequest:
    return pp.PlaceRequest(
        num_nodes=draw(int32),
        gpus_per_node=draw(int32),
        mode=draw(st.sampled_from(list(pp.PlacementMode))),
        segment_size=draw(int32),
        node_selector=draw(st.dictionaries(text, text, max_size=3)),
        excluded_nodes=draw(st.lists(text, max_size=4)),
        policy=draw(st.sampled_from(list(pp.Policy))),
        dry_run=draw(st.booleans()),
        domain_uid=draw(text),
        reserve=draw(st.booleans()),
        reservation_ttl_seconds=draw(int32),
        holder=draw(text),
        seed=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        candidate_nodes=draw(st.lists(text, max_size=4)),
    )


@settings(max_examples=200, deadline=None)
@given(place_requests())
def test_decoding_matches_the_generated_parser(message: pp.PlaceRequest) -> None:
    data = bytes(message)
    assert decode_place_request(data) == to_request(pp.PlaceRequest().parse(data))


@st.composite
def decisions(draw: st.DrawFn) -> Decision:
    reason = draw(st.sampled_from([None, *Reason]))
    segments: tuple[Segment, ...] = ()
    if reason is None:
        segments = tuple(
            Segment(draw(text), tuple(draw(st.lists(text, min_size=1, max_size=20))))
            for _ in range(draw(st.integers(0, 3)))
        )
    reservation = None
    if draw(st.booleans()):
        reservation = ReservationInfo(draw(text), (), (), "", "", 60, draw(st.integers(0, 2**62)))
    finite = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
    return Decision(
        policy=draw(st.sampled_from(list(PolicyName))),
        segments=segments,
        score=draw(finite),
        fragmentation_before=draw(finite),
        fragmentation_after=draw(finite),
        largest_free_block_before=draw(st.integers(0, 300)),
        largest_free_block_after=draw(st.integers(0, 300)),
        reason=reason,
        message=draw(text),
        reservation=reservation,
    )


@settings(max_examples=200, deadline=None)
@given(decisions())
def test_encoding_is_byte_identical_to_the_generated_serializer(decision: Decision) -> None:
    wire = encode_place_response(decision)
    assert wire == bytes(to_response(decision))
    assert pp.PlaceResponse().parse(wire) == to_response(decision)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"\x08", "request"),  # truncated varint
        (b"\x0a\x05ab", "request"),  # length beyond the end
        (bytes(pp.PlaceRequest(num_nodes=1)) + b"\x18\x63", "mode"),  # mode 99
        (bytes(pp.PlaceRequest(num_nodes=1)) + b"\x38\x2a", "policy"),  # policy 42
        (b"\x4a\x02\xff\xfe", "domain_uid"),  # not UTF-8
    ],
)
def test_bad_bytes_are_invalid_requests_naming_the_field(data: bytes, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        decode_place_request(data)
    assert err.value.field == field


def test_unknown_fields_are_skipped() -> None:
    data = bytes(pp.PlaceRequest(num_nodes=3)) + b"\xf8\x07\x01" + b"\xfd\x07\x00\x00\x00\x00"
    assert decode_place_request(data).num_nodes == 3


@settings(max_examples=100, deadline=None)
@given(reservation_id=text, holder=text, released=st.booleans(), nodes=st.lists(text, max_size=20))
def test_release_coding_matches_the_generated_classes(
    reservation_id: str, holder: str, released: bool, nodes: list[str]
) -> None:
    request = bytes(pp.ReleaseRequest(reservation_id=reservation_id, holder=holder))
    assert decode_release_request(request + b"\xf8\x07\x01") == (reservation_id, holder)
    expected = bytes(pp.ReleaseResponse(released=released, node_names=nodes))
    assert encode_release_response(released, nodes) == expected


def test_an_undecodable_release_request_names_the_field() -> None:
    with pytest.raises(InvalidRequest) as err:
        decode_release_request(b"\x0a\x02\xff\xfe")
    assert err.value.field == "reservation_id"
    with pytest.raises(InvalidRequest) as err:
        decode_release_request(b"\x0a\x09ab")
    assert err.value.field == "request"
