"""The one reading of a stored ComputeDomain (libs/state/domain_record.py) agrees with the full
record: its fields, its readiness, and the record it writes back."""

from __future__ import annotations

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state import codec
from libs.state.domain_record import DomainRecord, from_full


def _domain(readiness: pb.Readiness, nodes: int) -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid="cd-1",
        namespace="ns",
        name="job",
        deleting=True,
        status=pb.ComputeDomainStatus(
            status=readiness,
            nodes=[
                pb.NodeStatus(name=f"n{i}", ip_address=f"127.0.0.{i}", index=i, status=pb.Readiness.READY)
                for i in range(nodes)
            ],
            conditions=[pb.Condition(type="Ready", status="True")],
        ),
        mesh_mode=pb.MeshMode.PLAINTEXT,
    )


@pytest.mark.parametrize("readiness", list(pb.Readiness))
@pytest.mark.parametrize("nodes", [0, 1, 256])
def test_readiness_matches_the_full_record(readiness: pb.Readiness, nodes: int) -> None:
    stored = codec.encode(_domain(readiness, nodes))
    light = codec.decode(stored, DomainRecord)
    assert light.uid == "cd-1"
    assert light.ready == (codec.decode(stored, pb.ComputeDomain).status.status == pb.Readiness.READY)


def test_another_kind_is_refused() -> None:
    with pytest.raises(codec.UndecodableValue, match=r"expected 'computedomain\.state\.v1\.ComputeDomain'"):
        codec.decode(codec.encode(pb.Member(node_name="n1")), DomainRecord)


@pytest.mark.parametrize("nodes", [0, 256])
def test_every_field_but_the_status_is_read_and_the_status_is_kept_exactly(nodes: int) -> None:
    full = _domain(pb.Readiness.READY, nodes)
    full.spec = pb.ComputeDomainSpec(num_nodes=4)
    full.created_unix_ms, full.deletion_requested_unix_ms, full.source = 5, 6, "kubernetes"
    record = codec.decode(codec.encode(full), DomainRecord)
    assert (record.uid, record.namespace, record.name, record.deleting, record.mesh_mode) == (
        "cd-1",
        "ns",
        "job",
        True,
        pb.MeshMode.PLAINTEXT,
    )
    assert (
        record.spec.num_nodes,
        record.created_unix_ms,
        record.deletion_requested_unix_ms,
        record.source,
    ) == (
        4,
        5,
        6,
        "kubernetes",
    )
    assert pb.ComputeDomainStatus().parse(record.status) == full.status
    # Written back (the controller's status writes), the record is the full message again.
    assert codec.decode(codec.encode(record), pb.ComputeDomain) == full
    assert bytes(from_full(full)) == bytes(full)
