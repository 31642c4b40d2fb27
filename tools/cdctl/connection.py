"""How cdctl reaches the store: flags, environment, or the running cdsim cluster."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from libs.state.config import EtcdConfig
from tools.cdsim import credentials
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState

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


def _running_cluster(args: argparse.Namespace) -> RunState | None:
    """The cdsim cluster to talk to, when no endpoint is given."""
    if args.etcd_endpoint:
        return None
    state = RunState.load(StateLayout.at(args.state_dir))
    if state is not None and state.phase == "ready" and state.etcd_endpoint:
        return state
    return None


def resolve_endpoint(args: argparse.Namespace) -> str:
    if args.etcd_endpoint:
        return str(args.etcd_endpoint)
    state = _running_cluster(args)
    return state.etcd_endpoint if state is not None else DEFAULT_ENDPOINT


def etcd_config(args: argparse.Namespace) -> EtcdConfig:
    """Raises ValueError with a message naming the bad flag combination.

    A secured cdsim cluster's client certificate is taken from its state dir unless TLS or a user is
    given explicitly."""
    state = _running_cluster(args)
    explicit = args.etcd_ca_file or args.etcd_cert_file or args.etcd_username
    if state is not None and state.tls_dir and not explicit:
        run_credentials = credentials.Credentials(Path(state.tls_dir))
        config = run_credentials.etcd_config(state.etcd_endpoint, prefix=args.etcd_prefix)
        return replace(config, timeout_s=args.timeout)
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
