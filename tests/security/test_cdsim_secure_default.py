"""`cdsim up` is secured by default, and `cdsim up --plaintext` is not.

The default run (services at log level debug) is shared by the tests of this module, which run in
order: the certificates in the state dir -> etcd refuses a client without a certificate of the
run's CA, and each service is its own etcd user with its role -> the advisor refuses a client
without a certificate -> cdsim, cdctl and the dashboard work without a flag -> stopped, and no
private key or token in any log line. The last test runs a plaintext cluster.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state import roles
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests import address_blocks
from tests.cdsim.cli import cdsim, ok, run_state, status
from tests.security.leaks import find_leaks, key_bodies
from tools.cdsim import credentials
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes
from tools.controlplane.pki import issue_from_ca, new_ca
from tools.dashboard.cdsim_hook import dashboard_url

pytestmark = pytest.mark.slow

TRAYS = 3
JOB = "secure"
# What a client without a certificate of the advisor's CA sees: the handshake or the stream fails.
REFUSED = (OSError, ssl.SSLError, ConnectionError, StreamTerminatedError)
# etcd refuses the handshake; the gRPC client reports it as a failure to connect.
ETCD_REFUSED = r"(?i)failed to connect|unavailable|handshake|certificate"


def _up(*flags: str, block: int, trays: int) -> Path:
    # Short, so the nodes' unix socket paths stay under 108 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix="cdsec-"))
    ok(cdsim(state_dir, "up", "--racks", "1", "--trays", str(trays), "--address-block", str(block), *flags))
    return state_dir


def _down(state_dir: Path) -> None:
    cdsim(state_dir, "down", timeout=90)
    leftovers = cluster_processes(StateLayout.at(state_dir))
    shutil.rmtree(state_dir, ignore_errors=True)
    assert not leftovers, f"processes left running: {leftovers}"


@pytest.fixture(scope="module")
def secured() -> Iterator[Path]:
    state_dir = _up("--log-level", "debug", block=address_blocks.CDSIM_SECURE, trays=TRAYS)
    try:
        yield state_dir
    finally:
        _down(state_dir)


def test_up_makes_the_certificates_into_the_state_dir(secured: Path) -> None:
    pki = StateLayout.at(secured).pki_dir
    assert run_state(secured).tls_dir == str(pki)
    assert stat.S_IMODE(pki.stat().st_mode) == 0o700
    keys = sorted(pki.glob("*.key"))
    assert {k.stem for k in keys} == {
        credentials.ETCD_SERVER,
        credentials.ADVISOR_SERVER,
        credentials.ROOT,
        credentials.CLIENT,
        *roles.COMPONENTS,
    }
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys), [oct(k.stat().st_mode) for k in keys]
    # Nothing mints identities after `up`: the CA key is gone.
    assert not (pki / "ca.key").exists()
    assert "secured: etcd TLS and auth, advisor mutual TLS" in ok(cdsim(secured, "status"))


async def _revision(config: EtcdConfig) -> int:
    async with Store(config) as store:
        return await store.revision()


async def test_etcd_refuses_a_client_without_a_certificate_of_the_run(secured: Path, tmp_path: Path) -> None:
    state = run_state(secured)
    run = credentials.of_run(state)
    assert run is not None
    assert await _revision(credentials.etcd_config(state)) > 0
    with pytest.raises(Exception, match=ETCD_REFUSED):
        await _revision(EtcdConfig(endpoint=state.etcd_endpoint, timeout_s=2.0))
    with pytest.raises(Exception, match=ETCD_REFUSED):
        await _revision(EtcdConfig(endpoint=state.etcd_endpoint, ca_file=str(run.ca_file), timeout_s=2.0))
    # A certificate with a known user's name, from another CA.
    other = issue_from_ca(new_ca(tmp_path, "other-ca", "other"), tmp_path, "cdsim", credentials.CLIENT)
    forged = EtcdConfig(
        endpoint=state.etcd_endpoint,
        ca_file=str(run.ca_file),
        cert_file=str(other.cert),
        key_file=str(other.key),
        timeout_s=2.0,
    )
    with pytest.raises(Exception, match=ETCD_REFUSED):
        await _revision(forged)


async def test_each_service_is_its_own_etcd_user_with_its_role(secured: Path) -> None:
    state = run_state(secured)
    run = credentials.of_run(state)
    assert run is not None
    for component in (roles.NODE_AGENT, roles.IMEX_AGENT, roles.ADVISOR):
        async with Store(run.etcd_config(state.etcd_endpoint, component)) as store:
            with pytest.raises(Exception, match=r"(?i)permission denied"):
                await store.list(store.keys.mesh_authorities(), pb.MeshAuthority)
            nodes, _ = await store.list(store.keys.nodes(), pb.Node)
            assert len(nodes) == TRAYS
    async with Store(run.etcd_config(state.etcd_endpoint, roles.CONTROLLER)) as store:
        await store.list(store.keys.mesh_authorities(), pb.MeshAuthority)


async def _dry_run_place(endpoint: str, tls: ssl.SSLContext | None, nodes: int = TRAYS) -> pp.PlaceResponse:
    host, port = endpoint.rsplit(":", 1)
    channel = Channel(host, int(port), ssl=tls)
    try:
        stub = pp.PlacementAdvisorStub(channel, timeout=10)
        return await stub.place(pp.PlaceRequest(num_nodes=nodes, dry_run=True))
    finally:
        channel.close()


async def test_the_advisor_refuses_a_client_without_a_certificate(secured: Path) -> None:
    state = run_state(secured)
    run = credentials.of_run(state)
    assert run is not None
    with pytest.raises(REFUSED):
        await _dry_run_place(state.advisor_endpoint, None)
    no_certificate = ssl.create_default_context(cafile=str(run.ca_file))
    no_certificate.set_alpn_protocols(["h2"])
    with pytest.raises(REFUSED):
        await _dry_run_place(state.advisor_endpoint, no_certificate)
    placed = await _dry_run_place(state.advisor_endpoint, credentials.advisor_tls(state))
    assert placed.feasible


def test_cdsim_cdctl_and_the_dashboard_need_no_flag(secured: Path) -> None:
    text = ok(cdsim(secured, "job", "submit", JOB, "--nodes", str(TRAYS), "--wait"))
    assert "ComputeDomain status: Ready" in text
    assert f"default/{JOB}: all {TRAYS * (TRAYS - 1)} imports valid" in ok(
        cdsim(secured, "job", "check", JOB)
    )
    assert "invariants 1-4 hold" in ok(cdsim(secured, "check"))
    table = subprocess.run(
        [sys.executable, "-m", "tools.cdctl.main", "get", "computedomains", "--state-dir", str(secured)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert table.returncode == 0, table.stderr
    assert JOB in table.stdout and "Ready" in table.stdout
    url = dashboard_url(run_state(secured))
    with urllib.request.urlopen(f"{url}api/state", timeout=10) as resp:
        page = json.loads(resp.read())
    assert page["synced"] and sum(len(r["trays"]) for r in page["racks"]) == TRAYS
    assert any(d["name"] == JOB for d in status(secured)["domains"])
    ok(cdsim(secured, "job", "delete", JOB, "--wait"))
    assert "invariants 1-4 hold" in ok(cdsim(secured, "check", "--idle"))


def test_no_private_key_or_token_in_any_log_line(secured: Path) -> None:
    ok(cdsim(secured, "down", timeout=90))
    layout = StateLayout.at(secured)
    logs = {path.stem: path.read_text(errors="replace") for path in sorted(layout.logs_dir.glob("*.log"))}
    assert {"etcd", "supervisor", "advisor", "controller-0", "controller-1", "dashboard"} <= set(logs)
    services = {name: text for name, text in logs.items() if name not in ("etcd", "forkserver")}
    # At debug level, and they talked to etcd: the logs are not trivially empty.
    assert all(len(text.splitlines()) >= 5 for text in services.values()), {
        k: len(v.splitlines()) for k, v in services.items()
    }
    keys = key_bodies(layout.pki_dir.glob("*.key"))
    assert len(keys) == 2 + 2 + len(roles.COMPONENTS)
    leaks = find_leaks(logs, keys, {})
    assert not leaks, "\n".join(leaks)


def test_plaintext_runs_without_certificates() -> None:
    state_dir = _up("--plaintext", block=address_blocks.CDSIM_PLAINTEXT, trays=2)
    try:
        state = run_state(state_dir)
        assert state.tls_dir == "" and not StateLayout.at(state_dir).pki_dir.exists()
        assert "plaintext: etcd without TLS or auth" in ok(cdsim(state_dir, "status"))
        assert asyncio.run(_revision(EtcdConfig(endpoint=state.etcd_endpoint, timeout_s=2.0))) > 0
        assert asyncio.run(_dry_run_place(state.advisor_endpoint, None, nodes=2)).feasible
        assert "ComputeDomain status: Ready" in ok(
            cdsim(state_dir, "job", "submit", "plain", "--nodes", "2", "--wait")
        )
    finally:
        _down(state_dir)
