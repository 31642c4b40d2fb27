"""Certificates of a domain's IMEX mesh (pure: no I/O, no clock of its own).

Each ComputeDomain has its own certificate authority. A node makes its key, sends a request
naming itself and the domain, and the controller signs it with the names *it* decides: the
member's slot name (the name peers dial, so TLS hostname checks bind a certificate to one slot of
one domain), the node's address and a URI naming domain and node. ECDSA P-256 keeps signing and
handshakes cheap at rack scale.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# File names in a daemon's directory; one set serves as server and client credentials.
MESH_KEY_FILE = "mesh.key"
MESH_CERT_FILE = "mesh.crt"
MESH_CA_FILE = "mesh-ca.crt"

_URI_PREFIX = "urn:computedomain:"
_CLOCK_SKEW = timedelta(minutes=5)


class MeshPkiError(ValueError):
    """A request, certificate or key that must not be used; the message names the problem."""


@dataclass(frozen=True)
class DomainAuthority:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class CertificateFacts:
    domain_uid: str
    node: str
    dns_names: tuple[str, ...]
    addresses: tuple[str, ...]
    not_before: datetime
    not_after: datetime
    fingerprint: str  # sha256 of the DER, hex


def _uri(domain_uid: str, node: str) -> str:
    return f"{_URI_PREFIX}{domain_uid}:node:{node}"


def _private_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise MeshPkiError(f"not a usable PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise MeshPkiError("the mesh uses EC keys; this key is not one")
    return key


def _certificate(cert_pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise MeshPkiError(f"{what} is not a PEM certificate: {exc}") from None


def new_node_key() -> bytes:
    """A fresh private key (PEM, PKCS8, unencrypted: it is written only to the node, mode 0600)."""
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_domain_authority(domain_uid: str, *, now: datetime, validity: timedelta) -> DomainAuthority:
    if not domain_uid:
        raise MeshPkiError("a domain authority needs the domain uid")
    key_pem = new_node_key()
    key = _private_key(key_pem)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ComputeDomain"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"imex-mesh-ca {domain_uid}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{_URI_PREFIX}{domain_uid}")]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return DomainAuthority(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def certificate_request(key_pem: bytes, *, domain_uid: str, node: str) -> bytes:
    """A CSR for ``node`` in ``domain_uid``, signed by the node's key."""
    key = _private_key(key_pem)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, domain_uid),
                    x509.NameAttribute(NameOID.COMMON_NAME, node),
                ]
            )
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(_uri(domain_uid, node))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def _check_request(csr_pem: bytes, domain_uid: str, node: str) -> x509.CertificateSigningRequest:
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise MeshPkiError(f"the certificate request of node {node} is not a PEM CSR: {exc}") from None
    if not csr.is_signature_valid:
        raise MeshPkiError(f"the certificate request of node {node} is not signed by its own key")
    try:
        uris = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound:
        uris = []
    if uris != [_uri(domain_uid, node)]:
        raise MeshPkiError(
            f"the certificate request names {uris or 'nothing'}, not node {node} of domain {domain_uid}"
        )
    return csr


def sign_node_certificate(
    authority: DomainAuthority,
    csr_pem: bytes,
    *,
    domain_uid: str,
    node: str,
    dns_names: Sequence[str],
    address: str,
    now: datetime,
    validity: timedelta,
) -> bytes:
    """Sign ``node``'s request. The names come from the caller, never from the request."""
    csr = _check_request(csr_pem, domain_uid, node)
    if not dns_names:
        raise MeshPkiError(f"node {node}: a mesh certificate needs the member's slot name")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise MeshPkiError(f"node {node}: {address!r} is not an IP address") from None
    ca_cert = _certificate(authority.cert_pem, "the domain's CA certificate")
    ca_key = _private_key(authority.key_pem)
    not_after = min(now + validity, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, domain_uid),
                    x509.NameAttribute(NameOID.COMMON_NAME, node),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns_names]
                + [x509.IPAddress(ip), x509.UniformResourceIdentifier(_uri(domain_uid, node))]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def certificate_facts(cert_pem: bytes) -> CertificateFacts:
    cert = _certificate(cert_pem, "the node certificate")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise MeshPkiError("the certificate has no subject alternative names") from None
    domain_uid = node = ""
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        head, _, rest = uri.partition(_URI_PREFIX)
        if not head and ":node:" in rest:
            domain_uid, _, node = rest.partition(":node:")
    return CertificateFacts(
        domain_uid=domain_uid,
        node=node,
        dns_names=tuple(san.get_values_for_type(x509.DNSName)),
        addresses=tuple(str(a) for a in san.get_values_for_type(x509.IPAddress)),
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        fingerprint=hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest(),
    )


def verify_issued_by(cert_pem: bytes, ca_cert_pem: bytes, *, now: datetime) -> None:
    """Raise MeshPkiError unless ``cert_pem`` is signed by the CA and valid at ``now``."""
    cert = _certificate(cert_pem, "the node certificate")
    ca = _certificate(ca_cert_pem, "the CA certificate")
    public_key = ca.public_key()
    if cert.issuer != ca.subject or not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise MeshPkiError("the certificate is not issued by this domain's CA")
    try:
        public_key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise MeshPkiError("the certificate's signature is not this domain's CA's") from None
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise MeshPkiError(
            f"the certificate is valid from {cert.not_valid_before_utc} to {cert.not_valid_after_utc}, not at {now}"
        )


def key_matches_certificate(key_pem: bytes, cert_pem: bytes) -> bool:
    key = _private_key(key_pem)
    cert = _certificate(cert_pem, "the node certificate")
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(*raw) == cert.public_key().public_bytes(*raw)
