"""How cdctl reaches the store: flags, environment, or the running cdsim cluster."""

from __future__ import annotations

import argparse
import os

from libs.state.config import EtcdConfig
from tools.cdsim.layout import StateLayout
from tools.cdsim.runstate import RunState

DEFAULT_ENDPOINT = "127.0.0.1:2379"
PASSWORD_ENV = "CDCTL_ETCD_PASSWORD"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--etcd-endpoint",
        help=f"etcd host:port (default: the running cdsim cluster's, else {DEFAULT_ENDPOINT})",
    )
    group.add_argument("--state-dir", help="cdsim state directory to take the endpoint from")
    group.add_argument("--etcd-prefix", default="/cd/v1/", help="key prefix of the deployment")
    group.add_argument("--etcd-ca-file", help="CA bundle; enables TLS")
    group.add_argument("--etcd-cert-file", help="client certificate (with --etcd-key-file)")
    group.add_argument("--etcd-key-file", help="client key")
    group.add_argument("--etcd-username", help="etcd user (RBAC)")
    group.add_argument(
        "--etcd-password",
        help=f"etcd password (prefer the {PASSWORD_ENV} environment variable: no shell history)",
    )
    group.add_argument("--timeout", type=float, default=5.0, help="deadline of each etcd call, seconds")


def resolve_endpoint(args: argparse.Namespace) -> str:
    if args.etcd_endpoint:
        return str(args.etcd_endpoint)
    state = RunState.load(StateLayout.at(args.state_dir))
    if state is not None and state.phase == "ready" and state.etcd_endpoint:
        return state.etcd_endpoint
    return DEFAULT_ENDPOINT


def etcd_config(args: argparse.Namespace) -> EtcdConfig:
    """Raises ValueError with a message naming the bad flag combination."""
    password = args.etcd_password or os.environ.get(PASSWORD_ENV)
    return EtcdConfig(
        endpoint=resolve_endpoint(args),
        prefix=args.etcd_prefix,
        ca_file=args.etcd_ca_file,
        cert_file=args.etcd_cert_file,
        key_file=args.etcd_key_file,
        username=args.etcd_username,
        password=password if args.etcd_username else None,
        timeout_s=args.timeout,
    )
