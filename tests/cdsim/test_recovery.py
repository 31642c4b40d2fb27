"""A killed node's daemon waits for recovery, visibly; a node on an older driver is refused.

NVIDIA's IMEX guide ("Connections, Quorum, and Clean up"): after an unclean stop a new
nvidia-imex waits until the nodes that imported its memory reconnect. On a cdsim cluster a job's
workload imports from every other member, so a killed member's new daemon waits for all of them;
when one of them is killed too, the wait lasts until it is back, and the status says so all along.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.contract.names import REASON_DRIVER_TOO_OLD, REASON_WAITING_FOR_RECOVERY
from libs.gen.computedomain.state import v1 as pb
from tests import address_blocks
from tests.cdsim.cli import cdsim, ok, run_state, status
from tests.polling import wait_until
from tools.cdsim.jobs import open_store
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes

pytestmark = pytest.mark.slow

ADDRESS_BLOCK = address_blocks.CDSIM_RECOVERY
JOB = "recover"


def _up(*args: str) -> Path:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-r"))
    ok(cdsim(state_dir, "up", "--racks", "1", "--address-block", str(ADDRESS_BLOCK), *args))
    return state_dir


def _down(state_dir: Path) -> None:
    cdsim(state_dir, "down", timeout=90)
    leftovers = cluster_processes(StateLayout.at(state_dir))
    shutil.rmtree(state_dir, ignore_errors=True)
    assert not leftovers, f"processes left running: {leftovers}"


@pytest.fixture
def cluster() -> Iterator[Path]:
    state_dir = _up("--trays", "4")
    try:
        yield state_dir
    finally:
        _down(state_dir)


def domain_of(state_dir: Path, name: str) -> dict:
    return next(d for d in status(state_dir)["domains"] if d["name"] == name)


def daemon_record(state_dir: Path, uid: str, node: str) -> pb.DaemonStatus | None:
    async def read() -> pb.DaemonStatus | None:
        store = open_store(run_state(state_dir))
        async with store:
            item = await store.get(store.keys.daemon(uid, node), pb.DaemonStatus)
        return item.value if item is not None else None

    return asyncio.run(read())


def test_a_killed_node_waits_for_its_importers_and_a_killed_importer_keeps_the_wait_visible(
    cluster: Path,
) -> None:
    out = ok(cdsim(cluster, "job", "submit", JOB, "--nodes", "3", "--wait", "--timeout", "60"))
    assert "workload imported memory" in out
    domain = domain_of(cluster, JOB)
    uid = domain["uid"]
    victim, importer, other = sorted(domain["nodes"], key=lambda n: n["index"])
    before = victim["daemon_pid"]

    # The victim comes back after 3 s; one node that imported its memory stays down for 25 s.
    ok(cdsim(cluster, "fault", "kill-node", importer["name"], "--down-for", "25"))
    ok(cdsim(cluster, "fault", "kill-node", victim["name"], "--down-for", "3"))
    waiting = wait_until(
        lambda: (
            (r := daemon_record(cluster, uid, victim["name"])) is not None
            and r.reason == REASON_WAITING_FOR_RECOVERY
            and r
        ),
        "the returning node's daemon reports its recovery wait",
        30,
    )
    assert waiting.pid != before and waiting.state != pb.DaemonState.READY
    assert f"{importer['name']} (slot {importer['index']})" in waiting.last_error
    # The domain says so too: NodeLost (the importer), naming the waiting daemon.
    lost = wait_until(
        lambda: (
            (d := domain_of(cluster, JOB))["reason"] == "NodeLost"
            and "waiting for recovery" in d["message"]
            and d
        ),
        "NodeLost naming the waiting daemon",
        30,
    )
    assert importer["name"] in lost["message"] and victim["name"] in lost["message"]
    # While the importer is away the reason stays, and the daemon is the same (no restart).
    for _ in range(5):
        record = daemon_record(cluster, uid, victim["name"])
        assert record is not None and record.reason == REASON_WAITING_FOR_RECOVERY
        assert record.state != pb.DaemonState.READY and record.pid == waiting.pid
        time.sleep(0.5)
    assert other["name"] not in waiting.last_error.partition("not connected now")[2]

    # The importer is back: its new instance reconnects, the wait ends, the domain is Ready.
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "90"))
    record = daemon_record(cluster, uid, victim["name"])
    assert record is not None and record.state == pb.DaemonState.READY and record.reason == ""
    assert record.pid == waiting.pid, "the wait ended by itself, not by a restart"
    log = (StateLayout.at(cluster).node(victim["name"]).imex_dir / uid / "nvidia-imex.log").read_text()
    assert "IMEX daemon state INITIALIZING -> WAITING_FOR_RECOVERY" in log
    assert "Recovery complete" in log
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))
    ok(cdsim(cluster, "job", "delete", JOB, "--wait", "--timeout", "60"))


def test_a_node_on_an_older_driver_is_refused_with_the_version_it_needs() -> None:
    state_dir = _up("--trays", "2", "--driver-version", "rack0-tray1=570.133.20")
    try:
        # kubelet's prepares on the old node fail at once (no 45 s wait), naming the version.
        submitted = cdsim(state_dir, "job", "submit", "old", "--nodes", "2", "--timeout", "10")
        said = submitted.stdout + submitted.stderr
        assert submitted.returncode != 0, said
        assert "cannot run on node rack0-tray1" in said and "ImexDriverTooOld" in said, said
        assert "570.158.01" in said, said
        out = ok(
            cdsim(state_dir, "job", "wait", "old", "--status", "NotReady", "--reason", REASON_DRIVER_TOO_OLD,
                  "--timeout", "60")
        )  # fmt: skip
        domain = domain_of(state_dir, "old")
        assert "rack0-tray1" in domain["message"] and "570.158.01" in domain["message"], out
        assert "rack0-tray0" not in domain["message"]
        record = daemon_record(state_dir, domain["uid"], "rack0-tray1")
        assert record is not None and record.state == pb.DaemonState.FAILED and record.pid == 0
    finally:
        _down(state_dir)
