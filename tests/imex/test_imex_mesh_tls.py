"""Mutual TLS between simulated IMEX daemons: only holders of the domain CA's certificate for their
own slot get in; outsiders are refused while the domain keeps running with its imports."""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from libs.imex import mesh_pki
from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT, MeshTlsFiles
from tests.imex.simdomain import SimCluster, SimNode, start
from tools.sim.imex import client

PORT = DEFAULT_CMD_PORT
DOMAIN = "cd-uid-1"


def now() -> datetime:
    return datetime.now(UTC)


def write_credentials(
    node: SimNode,
    index: int,
    authority: mesh_pki.DomainAuthority,
    *,
    validity: timedelta = timedelta(hours=1),
    cert_pem: bytes | None = None,
    key_pem: bytes | None = None,
) -> None:
    """The files the IMEX agent writes: the node's key, its certificate for slot ``index``, the CA."""
    node.directory.mkdir(parents=True, exist_ok=True)
    if cert_pem is None:
        key_pem = mesh_pki.new_node_key()
        csr = mesh_pki.certificate_request(key_pem, domain_uid=node.domain_uid, node=f"node-{index}")
        cert_pem = mesh_pki.sign_node_certificate(
            authority,
            csr,
            domain_uid=node.domain_uid,
            node=f"node-{index}",
            dns_names=[node.slot_name(index)],
            address=node.address,
            now=now(),
            validity=validity,
        )
    assert key_pem is not None
    files = MeshTlsFiles(
        key=str(node.directory / mesh_pki.MESH_KEY_FILE),
        cert=str(node.directory / mesh_pki.MESH_CERT_FILE),
        ca=str(node.directory / mesh_pki.MESH_CA_FILE),
    )
    Path(files.key).write_bytes(key_pem)
    Path(files.key).chmod(0o600)
    Path(files.cert).write_bytes(cert_pem)
    Path(files.ca).write_bytes(authority.cert_pem)
    node.mesh_tls = files


def expiry_of(node: SimNode) -> datetime:
    assert node.mesh_tls is not None
    return mesh_pki.certificate_facts(Path(node.mesh_tls.cert).read_bytes()).not_after


def remove_ca_file(node: SimNode) -> None:
    assert node.mesh_tls is not None
    Path(node.mesh_tls.ca).unlink()


def tls_domain(cluster: SimCluster, size: int, authority: mesh_pki.DomainAuthority) -> list[SimNode]:
    nodes = cluster.domain(size, DOMAIN)
    members = [n.address for n in nodes]
    for index, node in enumerate(nodes):
        write_credentials(node, index, authority)
        node.write_config(members)
    return nodes


def self_signed(node: SimNode, index: int) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node.slot_name(index))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now() - timedelta(minutes=5))
        .not_valid_after(now() + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node.slot_name(index))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def running_job(members: list[SimNode]) -> dict[int, str]:
    """Node 0 imports job-a from every other member; returns the exporters' instances."""
    for node_id in range(1, len(members)):
        await client.import_memory(members[0].address, PORT, "job-a", node_id, 1.0)
    return {i: (await members[i].status()).instance for i in range(len(members))}


async def assert_job_intact(members: list[SimNode], instances: dict[int, str]) -> None:
    await members[0].wait_connected(range(len(members)))
    found = await client.list_imports(members[0].address, PORT, 1.0)
    assert sorted((i.node_id, i.valid) for i in found) == [(i, True) for i in range(1, len(members))]
    for i, node in enumerate(members):
        assert node.proc is not None and node.proc.poll() is None
        assert (await node.status()).instance == instances[i]


async def test_a_tls_domain_forms_and_runs_a_job(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 3, ca)
    await start(nodes)
    instances = await running_job(nodes)
    await assert_job_intact(nodes, instances)
    assert "IMEX_ENABLE_AUTH_ENCRYPTION=1" in nodes[0].config_path.read_text()


async def outsider_is_refused(cluster: SimCluster, credentials: str) -> None:
    """Slot 3 is mapped to the outsider's address everywhere, so only its credentials are wrong."""
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 4, ca)
    members, outsider = nodes[:3], nodes[3]
    if credentials == "foreign-ca":
        write_credentials(
            outsider, 3, mesh_pki.new_domain_authority("cd-uid-2", now=now(), validity=timedelta(days=1))
        )
    elif credentials == "self-signed":
        cert, key = self_signed(outsider, 3)
        write_credentials(outsider, 3, ca, cert_pem=cert, key_pem=key)
    else:  # plain TCP: the outsider runs without TLS
        outsider.mesh_tls = None
    outsider.write_config([n.address for n in nodes])
    await start(members, members=3)
    instances = await running_job(members)

    outsider.spawn()
    for member in members:
        await member.wait_log(f"Refused connection from {outsider.address}: ", timeout_s=10)
    # Whichever side checks first: the member rejects the outsider's certificate, or the outsider
    # rejects the member's (and the member sees its alert). Either way no link comes up.
    expected = {
        "foreign-ca": ("unable to get local issuer certificate", "unknown ca"),
        "self-signed": ("self-signed certificate", "unknown ca"),
        "plain": ("TLS handshake failed",),
    }[credentials]
    refusals = [
        line
        for line in members[0].log_text().splitlines()
        if f"Refused connection from {outsider.address}" in line
    ]
    assert refusals and all(any(e in line for e in expected) for line in refusals), refusals
    status = await outsider.status()
    assert all(status.connections[i] != "CONNECTED" for i in range(3)), status.connections
    for member in members:
        assert (await member.status()).connections[3] != "CONNECTED"
    await assert_job_intact(members, instances)


async def test_a_daemon_with_another_domains_ca_is_refused(cluster: SimCluster) -> None:
    await outsider_is_refused(cluster, "foreign-ca")


async def test_a_daemon_with_a_self_signed_certificate_is_refused(cluster: SimCluster) -> None:
    await outsider_is_refused(cluster, "self-signed")


async def test_a_plain_tcp_daemon_is_refused(cluster: SimCluster) -> None:
    await outsider_is_refused(cluster, "plain")


async def test_a_plain_tcp_client_gets_nothing_but_a_closed_connection(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 2, ca)
    await start(nodes)
    instances = await running_job(nodes)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(nodes[0].address, DEFAULT_SERVER_PORT), 2)
    writer.write(b"HELLO node_id=1 domain=cd-uid-1\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a word in plaintext
    writer.close()
    await nodes[0].wait_log("Refused connection from 127.0.0.1: TLS handshake failed")
    await assert_job_intact(nodes, instances)


async def test_a_certificate_for_another_slot_is_refused(cluster: SimCluster) -> None:
    """Node 2 holds a genuine certificate of the domain, but for slot 1: it cannot pose as node 2."""
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 3, ca)
    stolen = (nodes[1].directory / mesh_pki.MESH_CERT_FILE).read_bytes()
    write_credentials(
        nodes[2], 1, ca, cert_pem=stolen, key_pem=(nodes[1].directory / mesh_pki.MESH_KEY_FILE).read_bytes()
    )
    nodes[2].write_config([n.address for n in nodes])
    await start(nodes[:2])
    nodes[2].spawn()
    await nodes[0].wait_log(
        f"Refused connection from {nodes[2].address}: the client certificate names", timeout_s=10
    )
    assert (await nodes[0].status()).connections[2] != "CONNECTED"


async def test_rotation_by_sigusr1_keeps_the_job_running(cluster: SimCluster) -> None:
    """Certificates that expire a few seconds after start; new ones are written and SIGUSR1 sent.
    The reconnections after SIGUSR1 can only succeed with the new certificates."""
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = cluster.domain(3, DOMAIN)
    for index, node in enumerate(nodes):
        write_credentials(node, index, ca, validity=timedelta(seconds=5))
        node.write_config([n.address for n in nodes])
    expires = expiry_of(nodes[0])
    await start(nodes)
    instances = await running_job(nodes)
    # A clock condition, not a guess: once past it the old certificates are invalid.
    await asyncio.sleep((expires - now()).total_seconds() + 0.2)
    for index, node in enumerate(nodes):
        write_credentials(node, index, ca, validity=timedelta(hours=1))
    for node in nodes:
        node.signal(signal.SIGUSR1)
    for node in nodes:
        await node.wait_log("Reloaded SSL credentials")
    await nodes[0].wait_log("Connection established to node 1 with address", count=2, timeout_s=10)
    await nodes[0].wait_log("Connection established to node 2 with address", count=2, timeout_s=10)
    await assert_job_intact(nodes, instances)


async def test_an_unreadable_credential_stops_the_daemon_at_start(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    (node,) = tls_domain(cluster, 1, ca)
    remove_ca_file(node)
    node.spawn()
    assert node.wait_exit() == 1
    assert "cannot load IMEX_SERVER_CERT_AUTH" in node.log_text()


async def test_gssapi_and_unknown_modes_stop_the_daemon(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    (node,) = tls_domain(cluster, 1, ca)
    text = node.config_path.read_text()
    for mode, error in (
        ("GSS_AUTH_ENCRYPT", "is not simulated"),
        ("", "needs IMEX_AUTH_ENCRYPTION_MODE=SSL_TLS"),
    ):
        node.config_path.write_text(
            text.replace("IMEX_AUTH_ENCRYPTION_MODE=SSL_TLS", f"IMEX_AUTH_ENCRYPTION_MODE={mode}")
        )
        proc = node.spawn()
        assert node.wait_exit() == 1
        assert proc.stderr is not None and error in proc.stderr.read().decode()
        proc.stderr.close()
