"""The ComputeDomain identity projection used on the prepare path agrees with the full record."""

from __future__ import annotations

import dataclasses

from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import encode
from libs.state.store import Store
from services.nodeagent.core.domain_header import DomainHeader, decode_domain_header


def full_domain() -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid="9a1f4c2e-0d1b-4c5e-8f7a-6b5c4d3e2f10",
        namespace="team-a",
        name="trainer",
        spec=pb.ComputeDomainSpec(num_nodes=18, channel=pb.ChannelSpec(resource_claim_template_name="ch")),
        status=pb.ComputeDomainStatus(
            status=pb.Readiness.READY,
            nodes=[
                pb.NodeStatus(name=f"rack0-tray{i}", ip_address=f"127.1.0.{i + 1}", index=i)
                for i in range(18)
            ],
        ),
        created_unix_ms=1_700_000_000_000,
        deleting=True,
        deletion_requested_unix_ms=1_700_000_100_000,
        source="kubernetes",
    )


def test_header_fields_have_the_record_numbers() -> None:
    record = {f.name: f.metadata["betterproto"] for f in dataclasses.fields(pb.ComputeDomain)}
    for f in dataclasses.fields(DomainHeader):
        meta = f.metadata["betterproto"]
        assert (meta.number, meta.proto_type) == (record[f.name].number, record[f.name].proto_type), f.name


def test_header_reads_a_full_record() -> None:
    header = decode_domain_header(encode(full_domain()), "k")
    assert header is not None
    assert (header.uid, header.namespace, header.name, header.deleting, header.source) == (
        "9a1f4c2e-0d1b-4c5e-8f7a-6b5c4d3e2f10",
        "team-a",
        "trainer",
        True,
        "kubernetes",
    )


def test_header_refuses_other_kinds_and_garbage() -> None:
    assert decode_domain_header(encode(pb.Member(domain_uid="x", namespace="team-a")), "k") is None
    assert decode_domain_header(b"\xff\x00garbage", "k") is None
    newer = pb.Envelope(schema_version=99, kind="computedomain.state.v1.ComputeDomain", payload=b"")
    assert decode_domain_header(bytes(newer), "k") is None


async def test_a_stored_domain_decodes_to_its_header(store: Store) -> None:
    """The raw bytes of a domain record as the store holds them (DeviceState reads them so)."""
    domain = full_domain()
    key = store.keys.domain(domain.uid)
    assert await store.client.get(key.encode()) is None
    await store.put(key, domain)
    found = await store.client.get(key.encode())
    assert found is not None
    header = decode_domain_header(found.value, key)
    assert header is not None and header.namespace == "team-a" and header.deleting
