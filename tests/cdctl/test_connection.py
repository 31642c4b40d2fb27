"""How cdctl finds the store: a secured cdsim cluster's client certificate from its state dir."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools.cdctl.connection import add_connection_flags, etcd_config
from tools.cdsim import credentials
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_flags(parser)
    return parser.parse_args(list(argv))


def _running(state_dir: Path, tls_dir: str) -> None:
    RunState(phase="ready", etcd_endpoint="127.0.0.1:41234", tls_dir=tls_dir).save(StateLayout.at(state_dir))


def test_a_secured_cluster_gives_its_client_certificate(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    _running(tmp_path, str(pki))
    config = etcd_config(_args("--state-dir", str(tmp_path), "--timeout", "3"))
    assert config.endpoint == "127.0.0.1:41234"
    assert (config.ca_file, config.cert_file, config.key_file) == (
        str(pki / "ca.crt"),
        str(pki / f"{credentials.CLIENT}.crt"),
        str(pki / f"{credentials.CLIENT}.key"),
    )
    assert config.timeout_s == 3.0 and config.username is None


def test_explicit_tls_flags_win_and_a_plaintext_cluster_needs_none(tmp_path: Path) -> None:
    _running(tmp_path, str(tmp_path / "pki"))
    config = etcd_config(_args("--state-dir", str(tmp_path), "--etcd-ca-file", "/x/ca.pem"))
    assert (config.ca_file, config.cert_file) == ("/x/ca.pem", None)
    _running(tmp_path, "")
    plain = etcd_config(_args("--state-dir", str(tmp_path)))
    assert (plain.endpoint, plain.ca_file, plain.cert_file) == ("127.0.0.1:41234", None, None)
