from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import SCHEMA_VERSION, UndecodableValue, decode, encode

names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)

members = st.builds(
    pb.Member,
    domain_uid=names,
    node_name=names,
    clique_id=names,
    index=st.integers(min_value=-1, max_value=2**31 - 1),
    state=st.sampled_from(list(pb.MemberState)),
    ip_address=names,
    joined_unix_ms=st.integers(min_value=0, max_value=2**62),
    namespace=names,
)

domains = st.builds(
    pb.ComputeDomain,
    uid=names,
    namespace=names,
    name=names,
    spec=st.builds(
        pb.ComputeDomainSpec,
        num_nodes=st.integers(min_value=0, max_value=10_000),
        channel=st.builds(
            pb.ChannelSpec,
            resource_claim_template_name=names,
            allocation_mode=st.sampled_from(list(pb.AllocationMode)),
        ),
    ),
    status=st.builds(
        pb.ComputeDomainStatus,
        status=st.sampled_from(list(pb.Readiness)),
        nodes=st.lists(
            st.builds(
                pb.NodeStatus, name=names, ip_address=names, clique_id=names, index=st.integers(-1, 17)
            ),
            max_size=5,
        ),
    ),
    deleting=st.booleans(),
)


@given(members)
def test_member_round_trip(member: pb.Member) -> None:
    assert decode(encode(member), pb.Member) == member


@given(domains)
def test_domain_round_trip(domain: pb.ComputeDomain) -> None:
    assert decode(encode(domain), pb.ComputeDomain) == domain


def test_wrong_kind_is_refused_with_the_key() -> None:
    data = encode(pb.Member(node_name="n1"))
    with pytest.raises(UndecodableValue) as err:
        decode(data, pb.ComputeDomain, key="/cd/v1/domains/x")
    assert "/cd/v1/domains/x" in str(err.value)
    assert "computedomain.state.v1.Member" in str(err.value)


def test_newer_schema_is_refused() -> None:
    env = pb.Envelope(schema_version=SCHEMA_VERSION + 1, kind="computedomain.state.v1.Member", payload=b"")
    with pytest.raises(UndecodableValue, match="schema version"):
        decode(bytes(env), pb.Member)


@given(st.binary(max_size=64))
def test_garbage_never_decodes_silently(data: bytes) -> None:
    # Random bytes either fail to decode or (vanishingly rarely) are a real envelope of that kind.
    try:
        decode(data, pb.Member)
    except UndecodableValue:
        return
    env = pb.Envelope().parse(data)
    assert env.kind == "computedomain.state.v1.Member"


def test_betterprotos_rust_codec_is_in_use() -> None:
    """The store's hot paths are measured with betterproto's Rust codec (a declared dependency);
    without it everything still works, several times slower, so its absence must not go unnoticed."""
    import betterproto
    import betterproto_rust_codec  # noqa: F401

    message = pb.Member(domain_uid="d", node_name="n", index=3)
    assert betterproto.Message.parse.__qualname__ == "__parse_patch"  # betterproto's hook for the codec
    assert pb.Member().parse(bytes(message)) == message
