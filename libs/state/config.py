"""Connection settings for etcd, shared by every service and tool."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.runtime.settings import positive, setting


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to authenticate to it.

    `endpoint` is "host:port". TLS is on when `ca_file` is set; a client
    certificate is presented when `cert_file` and `key_file` are set.
    Username/password authentication (etcd RBAC) is used when both are set.
    """

    endpoint: str = "127.0.0.1:2379"
    prefix: str = "/cd/v1/"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    # Deadline of every unary call (get, put, txn, lease), in seconds.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"invalid etcd endpoint {self.endpoint!r}: expected host:port")
        if (self.username is None) != (self.password is None):
            raise ValueError("etcd username and password must be given together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd client cert_file and key_file must be given together")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ValueError(f"invalid key prefix {self.prefix!r}: must start and end with '/'")
        if self.timeout_s <= 0:
            raise ValueError(f"invalid etcd timeout {self.timeout_s!r}: must be > 0")

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @classmethod
    def from_settings(cls, settings: EtcdSettings) -> EtcdConfig:
        """From a service's `etcd_*` settings (flags / CD_* variables; "" means not set)."""
        return cls(
            endpoint=settings.etcd_endpoint,
            prefix=settings.etcd_prefix,
            ca_file=settings.etcd_ca_file or None,
            cert_file=settings.etcd_cert_file or None,
            key_file=settings.etcd_key_file or None,
            username=settings.etcd_username or None,
            password=settings.etcd_password or None,
            timeout_s=settings.etcd_timeout_s,
        )


@dataclass(frozen=True)
class EtcdSettings:
    """The etcd settings every service has (flags ``--etcd-*``, variables ``CD_*ETCD_*``): the
    services' settings classes extend it, and `EtcdConfig.from_settings` reads it."""

    etcd_endpoint: str = setting("127.0.0.1:2379", "etcd endpoint host:port")
    etcd_prefix: str = setting("/cd/v1/", "key prefix of this deployment in etcd")
    etcd_ca_file: str = setting("", "CA bundle; enables TLS to etcd")
    etcd_cert_file: str = setting("", "client certificate for etcd (with --etcd-key-file)")
    etcd_key_file: str = setting("", "client key for etcd")
    etcd_username: str = setting("", "etcd user (RBAC auth, with --etcd-password)")
    etcd_password: str = setting("", "etcd password", secret=True)
    etcd_timeout_s: float = setting(5.0, "deadline of each etcd call, seconds", validate=positive)
