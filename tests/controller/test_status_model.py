"""The plain status model: protobuf round trip, and the direct encoder byte for byte."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from services.controller.status_model import ConditionEntry, NodeEntry, StatusValue, encode_status

text = st.text(max_size=40)
nodes = st.builds(NodeEntry, text, text, text, st.integers(-(2**31), 2**31 - 1), st.booleans())
conditions = st.builds(ConditionEntry, text, text, text, text, st.integers(-(2**62), 2**62))
statuses = st.builds(
    StatusValue,
    st.booleans(),
    st.lists(nodes, max_size=6).map(tuple),
    st.lists(conditions, max_size=3).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(statuses)
def test_direct_encoding_equals_protobuf_encoding(status: StatusValue) -> None:
    assert encode_status(status) == bytes(status.to_pb())
    assert StatusValue.from_pb(pb.ComputeDomainStatus().parse(encode_status(status))) == status


def test_direct_encoding_of_a_rack_scale_status_is_fast() -> None:
    status = StatusValue(
        True,
        tuple(
            NodeEntry(f"rack{i // 18}-tray{i % 18}", f"127.1.{i // 18}.{i % 18}", "uuid.1", i % 18, True)
            for i in range(256)
        ),
        (ConditionEntry("Ready", "True", "AllNodesReady", "256 of 256 node(s) ready", 1),),
    )
    started = time.perf_counter()
    for _ in range(10):
        direct = encode_status(status)
    direct_s = (time.perf_counter() - started) / 10
    started = time.perf_counter()
    reference = bytes(status.to_pb())
    betterproto_s = time.perf_counter() - started
    assert direct == reference
    # Loose bound (shared CI machines): the point is an order of magnitude, not a number.
    assert direct_s * 5 < betterproto_s, (direct_s, betterproto_s)
