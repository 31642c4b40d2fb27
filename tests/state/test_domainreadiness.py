"""The light readiness reading of a stored ComputeDomain agrees with the full record."""

from __future__ import annotations

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state import codec
from libs.state.domainreadiness import DomainReadiness


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
    light = codec.decode(stored, DomainReadiness)
    assert light.uid == "cd-1"
    assert light.ready == (codec.decode(stored, pb.ComputeDomain).status.status == pb.Readiness.READY)


def test_another_kind_is_refused() -> None:
    with pytest.raises(codec.UndecodableValue, match=r"expected 'computedomain\.state\.v1\.ComputeDomain'"):
        codec.decode(codec.encode(pb.Member(node_name="n1")), DomainReadiness)
