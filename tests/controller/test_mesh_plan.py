"""The controller's mesh decisions (pure): a mode once per domain, a certificate only for a member's
current request, nothing kept for a node that is not a member."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from services.controller.actions import DeleteMeshCredentials, SecureMesh, SignMeshCertificate
from services.controller.mesh_plan import mesh_actions
from services.controller.mesh_view import MeshRequestRecord
from services.controller.observed import DomainObservation, MemberRecord

GRACE = 30_000


def member(node: str, index: int = 0, lost: bool = False, clique: str = "c.1") -> MemberRecord:
    return MemberRecord(node, clique, index, lost, "127.0.0.9", "ns", 0, 40 + index)


def obs(mode: pb.MeshMode = pb.MeshMode.MUTUAL_TLS, deleting: bool = False, **kw) -> DomainObservation:  # type: ignore[no-untyped-def]
    domain = DomainRecord(uid="d1", namespace="ns", name="cd", mesh_mode=mode, deleting=deleting)
    kw.setdefault("mesh_authority", mode == pb.MeshMode.MUTUAL_TLS)
    return DomainObservation(uid="d1", domain=domain, domain_revision=7, **kw)


def request(digest: str, at_ms: int = 0, revision: int = 90) -> MeshRequestRecord:
    return MeshRequestRecord(digest, at_ms, revision)


def test_an_undecided_domain_gets_the_controllers_mode_once() -> None:
    assert mesh_actions(obs(pb.MeshMode.UNDECIDED), True, 0, GRACE) == [SecureMesh(7, True)]
    assert mesh_actions(obs(pb.MeshMode.UNDECIDED), False, 0, GRACE) == [SecureMesh(7, False)]
    # Decided: the setting no longer matters.
    assert mesh_actions(obs(pb.MeshMode.PLAINTEXT), True, 0, GRACE) == []
    assert mesh_actions(obs(pb.MeshMode.MUTUAL_TLS), False, 0, GRACE) == []


def test_a_member_gets_a_certificate_for_its_current_request_only() -> None:
    o = obs(members={"n1": member("n1")}, mesh_requests={"n1": request("aa")})
    assert mesh_actions(o, True, 0, GRACE) == [SignMeshCertificate("n1", 90, 40)]
    answered = obs(
        members={"n1": member("n1")}, mesh_requests={"n1": request("aa")}, mesh_certificates={"n1": "aa"}
    )
    assert mesh_actions(answered, True, 0, GRACE) == []
    renewed = obs(
        members={"n1": member("n1")}, mesh_requests={"n1": request("bb")}, mesh_certificates={"n1": "aa"}
    )
    assert mesh_actions(renewed, True, 0, GRACE) == [SignMeshCertificate("n1", 90, 40)]


def test_no_certificate_without_a_ca_for_a_lost_or_non_fabric_member_or_in_plaintext() -> None:
    reqs = {"n1": request("aa")}
    assert (
        mesh_actions(
            obs(members={"n1": member("n1")}, mesh_requests=reqs, mesh_authority=False), True, 0, GRACE
        )
        == []
    )
    assert (
        mesh_actions(obs(members={"n1": member("n1", lost=True)}, mesh_requests=reqs), True, 0, GRACE) == []
    )
    assert (
        mesh_actions(obs(members={"n1": member("n1", -1, clique="")}, mesh_requests=reqs), True, 0, GRACE)
        == []
    )
    assert (
        mesh_actions(
            obs(pb.MeshMode.PLAINTEXT, members={"n1": member("n1")}, mesh_requests=reqs), True, 0, GRACE
        )
        == []
    )


def test_a_non_members_credentials_go_after_the_grace_and_at_once_when_the_domain_is_gone() -> None:
    young = obs(mesh_requests={"n2": request("aa", at_ms=1_000)}, mesh_certificates={"n3": "cc"})
    assert mesh_actions(young, True, 2_000, GRACE) == [DeleteMeshCredentials("n3")]
    assert mesh_actions(young, True, 1_000 + GRACE, GRACE) == [
        DeleteMeshCredentials("n2"),
        DeleteMeshCredentials("n3"),
    ]
    gone = DomainObservation(uid="d1", domain=None, mesh_requests={"n2": request("aa", at_ms=1_000)})
    assert mesh_actions(gone, True, 2_000, GRACE) == [DeleteMeshCredentials("n2")]
