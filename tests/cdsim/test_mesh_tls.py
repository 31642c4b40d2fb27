"""Mutual TLS between a domain's IMEX daemons, end to end: the controller's CA, keys that stay on
their nodes, rotation under a running job, teardown, and the plaintext setting."""

from __future__ import annotations

import asyncio
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.imex import mesh_pki, slots
from tests import address_blocks
from tests.cdsim.cli import cdsim, daemon_instances, ok, run_state, status
from tests.polling import wait_until
from tools.cdsim.jobs import open_store
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes

pytestmark = pytest.mark.slow

TRAYS = 4
ADDRESS_BLOCK = address_blocks.CDSIM_MESH_TLS
JOB = "secure"
VALIDITY_S = 12.0  # renewed at two thirds: every 8 s


def up(*flags: str, trays: int = TRAYS, block: int = ADDRESS_BLOCK) -> Path:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-m"))
    ok(cdsim(state_dir, "up", "--racks", "1", "--trays", str(trays), "--address-block", str(block), *flags))
    return state_dir


def down(state_dir: Path) -> None:
    cdsim(state_dir, "down", timeout=90)
    leftovers = cluster_processes(StateLayout.at(state_dir))
    shutil.rmtree(state_dir, ignore_errors=True)
    assert not leftovers, f"processes left running: {leftovers}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    state_dir = up("--mesh-certificate-validity-s", str(VALIDITY_S))
    try:
        out = ok(cdsim(state_dir, "job", "submit", JOB, "--nodes", "3", "--wait", timeout=180))
        assert "workload imported memory" in out
        yield state_dir
    finally:
        down(state_dir)


def domain_doc(state_dir: Path, name: str = JOB) -> dict[str, Any]:
    return dict(next(d for d in status(state_dir)["domains"] if d["name"] == name))


def member_dirs(state_dir: Path, name: str = JOB) -> list[Path]:
    doc = domain_doc(state_dir, name)
    layout = StateLayout.at(state_dir)
    return [layout.node(n["name"]).imex_dir / doc["uid"] for n in doc["nodes"]]


async def store_values(state_dir: Path) -> dict[str, bytes]:
    """Every value in the store, raw."""
    store = open_store(run_state(state_dir))
    async with store:
        result = await store.client.get_prefix(store.keys.prefix.encode())
        return {kv.key.decode(): bytes(kv.value) for kv in result}


def test_the_domain_runs_mutual_tls_with_certificates_for_each_members_slot(cluster: Path) -> None:
    doc = domain_doc(cluster)
    assert doc["status"] == "Ready" and doc["imex_mesh"] == "MutualTLS"
    layout = StateLayout.at(cluster)
    for node in doc["nodes"]:
        directory = layout.node(node["name"]).imex_dir / doc["uid"]
        config = (directory / "config.cfg").read_text()
        assert "IMEX_ENABLE_AUTH_ENCRYPTION=1" in config and "IMEX_AUTH_ENCRYPTION_MODE=SSL_TLS" in config
        facts = mesh_pki.certificate_facts((directory / mesh_pki.MESH_CERT_FILE).read_bytes())
        assert (facts.domain_uid, facts.node) == (doc["uid"], node["name"])
        assert facts.dns_names == (slots.slot_name(doc["uid"], node["clique"], node["index"]),)
        assert facts.addresses == (node["address"],)
    assert "all 6 imports valid" in ok(cdsim(cluster, "job", "check", JOB))


def test_key_files_are_for_root_only_and_no_node_key_is_in_the_store_or_the_logs(cluster: Path) -> None:
    for directory in member_dirs(cluster):
        for name in (mesh_pki.MESH_KEY_FILE, mesh_pki.MESH_CERT_FILE, mesh_pki.MESH_CA_FILE):
            mode = stat.S_IMODE((directory / name).stat().st_mode)
            assert mode == 0o600, f"{directory / name} has mode {oct(mode)}"
    values = asyncio.run(store_values(cluster))
    holders = sorted(key for key, value in values.items() if b"PRIVATE KEY" in value)
    uid = domain_doc(cluster)["uid"]
    assert holders == [f"/cd/v1/meshca/{uid}"], holders
    logs = StateLayout.at(cluster).logs_dir
    leaked = [p.name for p in logs.iterdir() if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]
    assert leaked == []


def test_rotation_under_the_running_job_keeps_every_import(cluster: Path) -> None:
    uid = domain_doc(cluster)["uid"]
    before = asyncio.run(daemon_instances(cluster, uid))
    logs = StateLayout.at(cluster).logs_dir
    rotated: dict[str, int] = {}

    def rotated_twice() -> bool:
        nonlocal rotated
        rotated = {
            node: len(re.findall(r'"rotation": true', (logs / f"imex-{node}.log").read_text()))
            for node in before
        }
        return all(count >= 2 for count in rotated.values())

    wait_until(
        rotated_twice,
        "two credential rotations on every node",
        4 * VALIDITY_S,
        explain=lambda: f"rotations per node: {rotated}",
    )
    for directory in member_dirs(cluster):
        assert "Reloaded SSL credentials" in (directory / "nvidia-imex.log").read_text()
    assert asyncio.run(daemon_instances(cluster, uid)) == before, "a daemon was restarted"
    assert "all 6 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    assert domain_doc(cluster)["status"] == "Ready"


def test_teardown_removes_the_ca_and_every_certificate(cluster: Path) -> None:
    ok(cdsim(cluster, "job", "delete", JOB, "--wait", timeout=120))
    assert "hold" in ok(cdsim(cluster, "check", "--idle", timeout=120))
    values = asyncio.run(store_values(cluster))
    assert [k for k in values if "/mesh" in k] == []


def test_the_plaintext_setting_runs_domains_without_tls() -> None:
    state_dir = up("--mesh", "plaintext", trays=2, block=ADDRESS_BLOCK + 1)
    try:
        ok(cdsim(state_dir, "job", "submit", "plain", "--nodes", "2", "--wait", timeout=180))
        doc = domain_doc(state_dir, "plain")
        assert doc["status"] == "Ready" and doc["imex_mesh"] == "Plaintext"
        for directory in member_dirs(state_dir, "plain"):
            assert "IMEX_ENABLE_AUTH_ENCRYPTION=0" in (directory / "config.cfg").read_text()
            assert not (directory / mesh_pki.MESH_KEY_FILE).exists()
        values = asyncio.run(store_values(state_dir))
        assert [k for k in values if "/mesh" in k] == []
    finally:
        down(state_dir)
