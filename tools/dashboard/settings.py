"""Settings of the dashboard (flags `--name`, environment `CD_DASHBOARD_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from libs.runtime.settings import non_negative, positive, setting
from libs.state.config import EtcdConfig

ENV_PREFIX = "CD_DASHBOARD_"
DEFAULT_ETCD_ENDPOINT = "127.0.0.1:2379"


@dataclass(frozen=True)
class DashboardSettings:
    etcd_endpoint: str = setting(
        "", "etcd host:port (default: the --state-dir cluster's, else 127.0.0.1:2379)"
    )
    etcd_prefix: str = setting("/cd/v1/", "key prefix of the deployment in etcd")
    etcd_ca_file: str = setting("", "CA bundle; enables TLS to etcd")
    etcd_cert_file: str = setting("", "client certificate for etcd (with --etcd-key-file)")
    etcd_key_file: str = setting("", "client key for etcd")
    etcd_username: str = setting("", "etcd user (RBAC auth, with --etcd-password)")
    etcd_password: str = setting("", "etcd password", secret=True)
    etcd_timeout_s: float = setting(5.0, "deadline of each etcd call, seconds", validate=positive)
    state_dir: str = setting(
        "", "a cdsim state directory: take the etcd endpoint and the rack layout from its cluster"
    )
    sim_cluster: str = setting(
        "",
        "simulated cluster description drawn as racks of trays (default: the --state-dir's; "
        "without one, racks are the NVLink cliques of the node records)",
    )
    host: str = setting("127.0.0.1", "address of the dashboard's HTTP server")
    port: int = setting(8090, "port of the dashboard (0 = any free port)", validate=non_negative)
    title: str = setting("ComputeDomains", "title shown on the page")
    keepalive_s: float = setting(
        15.0, "idle seconds before the event stream sends a keep-alive comment", validate=positive
    )
    log_format: str = setting("auto", "log format", choices=("json", "console", "auto"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))

    def etcd_config(self, endpoint: str) -> EtcdConfig:
        return EtcdConfig(
            endpoint=endpoint,
            prefix=self.etcd_prefix,
            ca_file=self.etcd_ca_file or None,
            cert_file=self.etcd_cert_file or None,
            key_file=self.etcd_key_file or None,
            username=self.etcd_username or None,
            password=self.etcd_password or None,
            timeout_s=self.etcd_timeout_s,
        )
