"""Connection settings for etcd, shared by every service and tool."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from libs.runtime.settings import positive, setting

DEFAULT_ENDPOINT = "127.0.0.1:2379"


def parse_endpoints(text: str) -> tuple[str, ...]:
    """The members of "host:port[,host:port...]", in order; a clear error for anything else."""
    endpoints = tuple(part.strip() for part in text.split(","))
    if not text.strip() or any(not e for e in endpoints):
        raise ValueError(f"invalid etcd endpoint {text!r}: expected host:port[,host:port...]")
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"invalid etcd endpoint {endpoint!r}: expected host:port")
    duplicates = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if duplicates:
        raise ValueError(f"etcd endpoint {duplicates[0]!r} is listed twice")
    return endpoints


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to authenticate to it.

    `endpoint` is "host:port", or the members of one etcd cluster as "host:port,host:port,...":
    the client talks to one member at a time and fails over to the next when that one is
    unreachable or no longer serves (`libs.state.client`). TLS is on when `ca_file` is set; a
    client certificate is presented when `cert_file` and `key_file` are set. Username/password
    authentication (etcd RBAC) is used when both are set.
    """

    endpoint: str = DEFAULT_ENDPOINT
    prefix: str = "/cd/v1/"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    # Deadline of every unary call (get, put, txn, lease), in seconds.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parse_endpoints(self.endpoint)
        if (self.username is None) != (self.password is None):
            raise ValueError("etcd username and password must be given together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd client cert_file and key_file must be given together")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ValueError(f"invalid key prefix {self.prefix!r}: must start and end with '/'")
        if self.timeout_s <= 0:
            raise ValueError(f"invalid etcd timeout {self.timeout_s!r}: must be > 0")

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every member, in the order the client tries them."""
        return parse_endpoints(self.endpoint)

    @property
    def host(self) -> str:
        """The first member's host."""
        return self.endpoints[0].rpartition(":")[0]

    @property
    def port(self) -> int:
        """The first member's port."""
        return int(self.endpoints[0].rpartition(":")[2])

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @classmethod
    def from_settings(cls, settings: EtcdSettings) -> EtcdConfig:
        """From a service's `etcd_*` settings (flags / CD_* variables; "" means not set)."""
        return cls(
            endpoint=settings.endpoint_list(),
            prefix=settings.etcd_prefix,
            ca_file=settings.etcd_ca_file or None,
            cert_file=settings.etcd_cert_file or None,
            key_file=settings.etcd_key_file or None,
            username=settings.etcd_username or None,
            password=settings.etcd_password or None,
            timeout_s=settings.etcd_timeout_s,
        )


def _endpoints_valid(value: str) -> str | None:
    try:
        parse_endpoints(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class EtcdSettings:
    """The etcd settings every service has (flags ``--etcd-*``, variables ``CD_*ETCD_*``): the
    services' settings classes extend it, and `EtcdConfig.from_settings` reads it."""

    etcd_endpoint: str = setting(
        DEFAULT_ENDPOINT,
        "etcd endpoint host:port; the members of one cluster as host:port,host:port (as --etcd-endpoints)",
        validate=_endpoints_valid,
    )
    etcd_endpoints: str = setting(
        "",
        "the members of one etcd cluster, host:port,host:port: the client talks to one and fails "
        "over to the next when it is unreachable or has no leader. Replaces --etcd-endpoint",
        validate=lambda value: _endpoints_valid(value) if value else None,
    )
    etcd_prefix: str = setting("/cd/v1/", "key prefix of this deployment in etcd")
    etcd_ca_file: str = setting("", "CA bundle; enables TLS to etcd")
    etcd_cert_file: str = setting("", "client certificate for etcd (with --etcd-key-file)")
    etcd_key_file: str = setting("", "client key for etcd")
    etcd_username: str = setting("", "etcd user (RBAC auth, with --etcd-password)")
    etcd_password: str = setting("", "etcd password", secret=True)
    etcd_timeout_s: float = setting(5.0, "deadline of each etcd call, seconds", validate=positive)

    def __repr__(self) -> str:
        """Every field, the secret ones (the etcd password) redacted; a settings class that
        extends this one keeps it with ``@dataclass(frozen=True, repr=False)``."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            shown.append(f"{f.name}={'<redacted>' if f.metadata.get('secret') and value else repr(value)}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def etcd_config(self) -> EtcdConfig:
        return EtcdConfig.from_settings(self)

    def endpoint_list(self) -> str:
        """The members to use, "host:port,...": --etcd-endpoints when given, else --etcd-endpoint.

        Both given and disagreeing is refused rather than one silently ignored."""
        if not self.etcd_endpoints:
            return self.etcd_endpoint
        listed = ",".join(parse_endpoints(self.etcd_endpoints))
        single = parse_endpoints(self.etcd_endpoint)
        if self.etcd_endpoint != DEFAULT_ENDPOINT and not set(single) <= set(parse_endpoints(listed)):
            raise ValueError(
                f"--etcd-endpoint {self.etcd_endpoint!r} is not among --etcd-endpoints {listed!r}: "
                "give one of them"
            )
        return listed
