"""The certificates of a secured cdsim cluster, and etcd's users and roles.

`cdsim up` (unless `--plaintext`) makes a CA and, signed by it, etcd's serving certificate, the
placement advisor's serving certificate and one client certificate per identity, all in
`<state dir>/pki/`. As the production overlay does (manifests/README.md), etcd requires a client
certificate of that CA and, with its authentication enabled, takes the user from the certificate's
CN: each component is its own etcd user with its role of `libs.state.roles`, and no password
exists anywhere. The advisor requires a client certificate of the same CA (mutual TLS).

cdsim's own commands, cdctl, the dashboard and the chaos tool are the user `cdsim` (read and
write of the whole prefix, as an operator has); they find its files through `run.json`
(`RunState.tls_*`), so no flag is needed.
"""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass
from pathlib import Path

from libs.state import enable_auth, roles
from libs.state.config import EtcdConfig
from tools.cdsim.run_state import RunState
from tools.controlplane.pki import CertKeyPair, issue_from_ca, new_ca

CA = "ca"
ETCD_SERVER = "etcd-server"
ADVISOR_SERVER = "advisor-server"
ROOT = enable_auth.ROOT  # etcd's root user: only to set up auth
CLIENT = "cdsim"  # cdsim's commands, cdctl, the dashboard, the chaos tool
LOOPBACK = "127.0.0.1"
AUTH_TIMEOUT_S = 5.0
# The etcd identity (certificate CN) of each service kind of tools.cdsim.services.
IDENTITY_OF_KIND = {
    "agent": roles.NODE_AGENT,
    "imex-agent": roles.IMEX_AGENT,
    "controller": roles.CONTROLLER,
    "advisor": roles.ADVISOR,
    "dashboard": CLIENT,
}


@dataclass(frozen=True)
class Credentials:
    """The PEM files under one directory, by name (`<name>.crt`, `<name>.key`)."""

    directory: Path

    def pair(self, name: str) -> CertKeyPair:
        return CertKeyPair(cert=self.directory / f"{name}.crt", key=self.directory / f"{name}.key")

    @property
    def ca_file(self) -> Path:
        return self.pair(CA).cert

    def etcd_flags(self, kind: str) -> list[str]:
        """A service's flags to reach etcd as its own identity."""
        pair = self.pair(IDENTITY_OF_KIND[kind])
        return [
            "--etcd-ca-file", str(self.ca_file),
            "--etcd-cert-file", str(pair.cert),
            "--etcd-key-file", str(pair.key),
        ]  # fmt: skip

    def advisor_flags(self) -> list[str]:
        """The advisor's mutual TLS on gRPC and the extender (as manifests/overlays/production)."""
        pair = self.pair(ADVISOR_SERVER)
        return [
            "--tls-cert-file", str(pair.cert),
            "--tls-key-file", str(pair.key),
            "--tls-client-ca-file", str(self.ca_file),
        ]  # fmt: skip

    def etcd_config(self, endpoint: str, identity: str = CLIENT, prefix: str = "/cd/v1/") -> EtcdConfig:
        pair = self.pair(identity)
        return EtcdConfig(
            endpoint=endpoint,
            prefix=prefix,
            ca_file=str(self.ca_file),
            cert_file=str(pair.cert),
            key_file=str(pair.key),
        )


def create(directory: Path) -> Credentials:
    """A fresh CA and every certificate a cluster needs (EC P-256: a few milliseconds each); the
    CA's key is deleted once they are issued."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    credentials = Credentials(directory)
    ca = new_ca(directory, CA, "cdsim-ca")
    issue_from_ca(ca, directory, ETCD_SERVER, "etcd", ip_addresses=(LOOPBACK,), server=True)
    issue_from_ca(
        ca, directory, ADVISOR_SERVER, roles.ADVISOR, ip_addresses=(LOOPBACK,), server=True, client=False
    )
    for identity in (ROOT, CLIENT, *roles.COMPONENTS):
        issue_from_ca(ca, directory, identity, identity)
    # Nothing issues certificates later: without the CA key no one can mint another identity.
    ca.key.unlink()
    return credentials


async def enable_etcd_auth(credentials: Credentials, endpoint: str, prefix: str = "/cd/v1/") -> None:
    """Users without passwords (the certificate's CN is the user) with the components' roles and
    cdsim's as an operator, then auth on. Nothing to do if auth is on already (etcd restarted on
    the same data)."""
    config = dataclasses.replace(credentials.etcd_config(endpoint, ROOT, prefix), timeout_s=AUTH_TIMEOUT_S)
    await enable_auth.enable_auth_at(config, operators=(CLIENT,))


def of_run(state: RunState) -> Credentials | None:
    """The client credentials of a running cluster (None: it runs in plaintext)."""
    return Credentials(Path(state.tls_dir)) if state.tls_dir else None


def etcd_config(state: RunState) -> EtcdConfig:
    """How a cdsim client reaches the cluster's etcd."""
    credentials = of_run(state)
    if credentials is None:
        return EtcdConfig(endpoint=state.etcd_endpoint)
    return credentials.etcd_config(state.etcd_endpoint)


def advisor_tls(state: RunState) -> ssl.SSLContext | None:
    """The client side of the advisor's mutual TLS (None: plaintext gRPC)."""
    credentials = of_run(state)
    if credentials is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(credentials.ca_file))
    pair = credentials.pair(CLIENT)
    context.load_cert_chain(str(pair.cert), str(pair.key))
    context.set_alpn_protocols(["h2"])
    return context
