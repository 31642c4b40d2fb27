"""Certificates and keys for a loopback test control plane.

One self-signed CA signs the apiserver's serving certificate and the client
certificates of the admin and of the control-plane components; a separate key
pair signs service-account tokens. ECDSA P-256 keeps generation instant.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)
# Allow for small clock differences between the generating and validating processes.
_BACKDATE = datetime.timedelta(minutes=5)
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclass(frozen=True)
class CertKeyPair:
    """PEM files of one certificate and its private key."""

    cert: Path
    key: Path

    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def key_pem(self) -> bytes:
        return self.key.read_bytes()


@dataclass(frozen=True)
class ControlPlanePKI:
    """Every file the control-plane processes need, all under one directory."""

    ca: CertKeyPair
    # Separate CA for the aggregation layer's request-header authentication, as kubeadm does.
    front_proxy_ca: CertKeyPair
    front_proxy_client: CertKeyPair
    apiserver_serving: CertKeyPair
    admin: CertKeyPair
    controller_manager: CertKeyPair
    scheduler: CertKeyPair
    service_account_key: Path
    service_account_pub: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _save_pair(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertKeyPair:
    pair = CertKeyPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    _write(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(pair.key, _key_pem(key), private=True)
    return pair


def _issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _self_signed_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .sign(key, hashes.SHA256())
    )
    return cert, key


def generate_pki(directory: Path, service_ip: str) -> ControlPlanePKI:
    """Write a fresh CA, serving/client certificates and service-account keys into `directory`.

    `service_ip` is the in-cluster IP of the `kubernetes` Service (first IP of the
    service range); it goes into the serving certificate's SANs as on a real cluster.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _self_signed_ca("computedomains-test-ca")
    ca = _save_pair(directory, "ca", ca_cert, ca_key)

    serving_key = _new_key()
    dns_names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
    ]
    serving = _save_pair(
        directory,
        "apiserver",
        _issue(ca_cert, ca_key, _name("kube-apiserver"), serving_key, ExtendedKeyUsageOID.SERVER_AUTH, sans),
        serving_key,
    )

    def client(
        stem: str,
        user: str,
        groups: tuple[str, ...] = (),
        issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] = (ca_cert, ca_key),
    ) -> CertKeyPair:
        key = _new_key()
        cert = _issue(issuer[0], issuer[1], _name(user, groups), key, ExtendedKeyUsageOID.CLIENT_AUTH)
        return _save_pair(directory, stem, cert, key)

    fp_cert, fp_key = _self_signed_ca("computedomains-test-front-proxy-ca")
    front_proxy_ca = _save_pair(directory, "front-proxy-ca", fp_cert, fp_key)

    sa_key = _new_key()
    sa_key_path = directory / "service-account.key"
    sa_pub_path = directory / "service-account.pub"
    _write(sa_key_path, _key_pem(sa_key), private=True)
    _write(
        sa_pub_path,
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )

    return ControlPlanePKI(
        ca=ca,
        front_proxy_ca=front_proxy_ca,
        front_proxy_client=client("front-proxy-client", FRONT_PROXY_CLIENT, issuer=(fp_cert, fp_key)),
        apiserver_serving=serving,
        admin=client("admin", "admin", ("system:masters",)),
        # These user names are what the apiserver's bootstrap RBAC policy binds.
        controller_manager=client("kube-controller-manager", "system:kube-controller-manager"),
        scheduler=client("kube-scheduler", "system:kube-scheduler"),
        service_account_key=sa_key_path,
        service_account_pub=sa_pub_path,
    )


def new_ca(directory: Path, stem: str, common_name: str) -> CertKeyPair:
    """A fresh self-signed CA written to `directory` (for a component's own client PKI)."""
    cert, key = _self_signed_ca(common_name)
    return _save_pair(directory, stem, cert, key)


def issue_from_ca(
    ca: CertKeyPair,
    directory: Path,
    stem: str,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = True,
) -> CertKeyPair:
    """Issue a certificate signed by an existing CA on disk (e.g. etcd's, which serves and is its own
    client; a kubelet's, user system:node:<name> in organization system:nodes)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem())
    ca_key = serialization.load_pem_private_key(ca.key_pem(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _new_key()
    usages = [
        u
        for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client))
        if on
    ]
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = _issue(ca_cert, ca_key, _name(common_name, organizations), key, usages[0], sans or None)
    if len(usages) > 1:
        # _issue sets one extended usage; re-sign with all of them.
        builder = x509.CertificateBuilder(
            issuer_name=cert.issuer,
            subject_name=cert.subject,
            public_key=cert.public_key(),
            serial_number=cert.serial_number,
            not_valid_before=cert.not_valid_before_utc,
            not_valid_after=cert.not_valid_after_utc,
            extensions=[e for e in cert.extensions if e.oid != x509.oid.ExtensionOID.EXTENDED_KEY_USAGE],
        ).add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
    return _save_pair(directory, stem, cert, key)
