"""The mesh's certificates: the controller decides the names; a request for another node, a key
that did not sign its request, another CA or an expired certificate is rejected."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from libs.imex import mesh_pki

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def authority(uid: str = "uid-1") -> mesh_pki.DomainAuthority:
    return mesh_pki.new_domain_authority(uid, now=NOW, validity=30 * DAY)


def sign(ca: mesh_pki.DomainAuthority, csr: bytes, node: str = "n1", uid: str = "uid-1") -> bytes:
    return mesh_pki.sign_node_certificate(
        ca,
        csr,
        domain_uid=uid,
        node=node,
        dns_names=["s3.abc.uid-1.imex.invalid"],
        address="127.0.1.3",
        now=NOW,
        validity=DAY,
    )


def test_a_signed_certificate_carries_the_names_the_controller_chose() -> None:
    ca = authority()
    key = mesh_pki.new_node_key()
    cert = sign(ca, mesh_pki.certificate_request(key, domain_uid="uid-1", node="n1"))
    facts = mesh_pki.certificate_facts(cert)
    assert (facts.domain_uid, facts.node) == ("uid-1", "n1")
    assert facts.dns_names == ("s3.abc.uid-1.imex.invalid",)
    assert facts.addresses == ("127.0.1.3",)
    assert facts.not_after == NOW + DAY
    mesh_pki.verify_issued_by(cert, ca.cert_pem, now=NOW)
    assert mesh_pki.key_matches_certificate(key, cert)
    assert not mesh_pki.key_matches_certificate(mesh_pki.new_node_key(), cert)


def test_a_request_for_another_node_or_domain_is_rejected() -> None:
    csr = mesh_pki.certificate_request(mesh_pki.new_node_key(), domain_uid="uid-1", node="n2")
    with pytest.raises(mesh_pki.MeshPkiError, match="not node n1 of domain uid-1"):
        sign(authority(), csr)
    other = mesh_pki.certificate_request(mesh_pki.new_node_key(), domain_uid="uid-2", node="n1")
    with pytest.raises(mesh_pki.MeshPkiError, match="not node n1 of domain uid-1"):
        sign(authority(), other)


def test_a_tampered_request_is_rejected() -> None:
    csr = mesh_pki.certificate_request(mesh_pki.new_node_key(), domain_uid="uid-1", node="n1")
    with pytest.raises(mesh_pki.MeshPkiError):
        sign(authority(), csr.replace(b"M", b"N", 3))


def test_another_ca_and_expiry_are_caught() -> None:
    ca = authority()
    cert = sign(ca, mesh_pki.certificate_request(mesh_pki.new_node_key(), domain_uid="uid-1", node="n1"))
    with pytest.raises(mesh_pki.MeshPkiError, match="not issued by this domain's CA"):
        mesh_pki.verify_issued_by(cert, authority("uid-2").cert_pem, now=NOW)
    with pytest.raises(mesh_pki.MeshPkiError, match="valid from"):
        mesh_pki.verify_issued_by(cert, ca.cert_pem, now=NOW + 2 * DAY)


def test_a_certificate_never_outlives_its_ca() -> None:
    ca = mesh_pki.new_domain_authority("uid-1", now=NOW, validity=timedelta(hours=2))
    cert = sign(ca, mesh_pki.certificate_request(mesh_pki.new_node_key(), domain_uid="uid-1", node="n1"))
    assert mesh_pki.certificate_facts(cert).not_after == NOW + timedelta(hours=2)
