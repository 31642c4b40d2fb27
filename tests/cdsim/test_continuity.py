"""Continuity (invariant 6): a running job survives every fault that does not kill one of its nodes.

One cdsim cluster (1 rack x 6 trays) runs a 3-node job whose workload imported memory from every
other member. Each fault below must leave the job's domain Ready *throughout* (a watch on the
domain record sees no other status), with the same indices, the same IMEX daemon pids and
instances, nodes configs untouched since their daemons started, and every import valid. Then a
whole node is killed: NodeLost within 10 s, peers untouched, and the node takes its index back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import address_blocks
from tests.cdsim.cli import ReadyWatch, cdsim, daemon_instances, ok, status
from tests.polling import wait_until
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes

pytestmark = pytest.mark.slow

TRAYS = 6
ADDRESS_BLOCK = address_blocks.CDSIM
JOB = "steady"
JOB_NODES = 3
PLUGIN_OUTAGE_S = 30
NODE_LOST_WITHIN_S = 10


@dataclass(frozen=True)
class MemberView:
    index: int
    daemon_pid: int
    instance: str
    nodes_config: tuple[int, float, str]  # inode, mtime, text

    @classmethod
    def of(cls, state_dir: Path, uid: str, node: dict[str, Any], instance: str) -> MemberView:
        path = StateLayout.at(state_dir).node(node["name"]).imex_dir / uid / "nodes_config.cfg"
        stat = path.stat()
        return cls(
            node["index"], node["daemon_pid"], instance, (stat.st_ino, stat.st_mtime, path.read_text())
        )


def members(state_dir: Path) -> dict[str, MemberView]:
    """Index, daemon pid and instance, and nodes config file of every member of the job."""
    doc = status(state_dir)
    domain = next(d for d in doc["domains"] if d["name"] == JOB)
    instances = asyncio.run(daemon_instances(state_dir, domain["uid"]))
    return {
        n["name"]: MemberView.of(state_dir, domain["uid"], n, instances[n["name"]]) for n in domain["nodes"]
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-c"))
    try:
        ok(
            cdsim(
                state_dir, "up", "--racks", "1", "--trays", str(TRAYS), "--address-block", str(ADDRESS_BLOCK)
            )
        )
        out = ok(cdsim(state_dir, "job", "submit", JOB, "--nodes", str(JOB_NODES), "--wait"))
        assert "workload imported memory" in out
        yield state_dir
    finally:
        cdsim(state_dir, "down", timeout=90)
        leftovers = cluster_processes(StateLayout.at(state_dir))
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leftovers, f"processes left running: {leftovers}"


def job_uid(state_dir: Path) -> str:
    return str(next(j for j in status(state_dir)["jobs"] if j["name"] == JOB)["domain_uid"])


def job_nodes(state_dir: Path) -> list[str]:
    return [c["node"] for c in next(j for j in status(state_dir)["jobs"] if j["name"] == JOB)["claims"]]


def assert_untouched(state_dir: Path, before: dict[str, MemberView], watch: ReadyWatch) -> None:
    assert watch.seen, "the watch saw no domain record"
    assert watch.not_ready() == [], f"the domain left Ready during the fault: {watch.not_ready()}"
    assert members(state_dir) == before, "an index, daemon pid, instance or nodes config changed"
    assert "all 6 imports valid" in ok(cdsim(state_dir, "job", "check", JOB))
    assert "invariants 1-4 hold" in ok(cdsim(state_dir, "check"))


def test_the_job_imported_from_every_other_member(cluster: Path) -> None:
    assert "all 6 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    job = next(j for j in status(cluster)["jobs"] if j["name"] == JOB)
    assert job["imports_intact"] is True


def node_doc(state_dir: Path, name: str) -> dict[str, Any]:
    return dict(next(n for n in status(state_dir)["nodes"] if n["name"] == name))


def wait_restarted(state_dir: Path, node: str, pid_key: str, old_pid: int, timeout_s: float) -> None:
    """Until the node's process named by `pid_key` runs again under a new pid (and is registered)."""
    doc: dict[str, Any] = {}

    def back() -> bool:
        nonlocal doc
        doc = node_doc(state_dir, node)
        return doc[pid_key] not in (0, old_pid) and bool(doc["registered"])

    wait_until(back, f"{pid_key} of {node} to come back", timeout_s, explain=lambda: f"last: {doc}")


def test_a_kubelet_plugin_down_for_30_s_changes_nothing(cluster: Path) -> None:
    before = members(cluster)
    victim = job_nodes(cluster)[0]
    old = node_doc(cluster, victim)["agent_pid"]
    with ReadyWatch(cluster, job_uid(cluster)) as watch:
        started = time.monotonic()
        ok(cdsim(cluster, "fault", "kill-agent", victim, "--down-for", str(PLUGIN_OUTAGE_S)))
        wait_restarted(cluster, victim, "agent_pid", old, PLUGIN_OUTAGE_S + 60)
        assert time.monotonic() - started >= PLUGIN_OUTAGE_S
    assert_untouched(cluster, before, watch)


def test_a_kubelet_plugin_stopped_and_started_again_changes_nothing(cluster: Path) -> None:
    """A rolling upgrade of the plugin DaemonSet: SIGTERM, then a new process."""
    before = members(cluster)
    victim = job_nodes(cluster)[1]
    old = node_doc(cluster, victim)["agent_pid"]
    with ReadyWatch(cluster, job_uid(cluster)) as watch:
        os.kill(old, signal.SIGTERM)
        wait_restarted(cluster, victim, "agent_pid", old, 60)
    assert_untouched(cluster, before, watch)


def test_an_imex_agent_down_for_15_s_changes_nothing(cluster: Path) -> None:
    """Its lease lapses, but its peers still report it connected: not lost; daemons adopted."""
    before = members(cluster)
    victim = job_nodes(cluster)[2]
    old = node_doc(cluster, victim)["imex_agent_pid"]
    with ReadyWatch(cluster, job_uid(cluster)) as watch:
        started = time.monotonic()
        ok(cdsim(cluster, "fault", "kill-imex-agent", victim, "--down-for", "15"))
        wait_restarted(cluster, victim, "imex_agent_pid", old, 75)
        assert time.monotonic() - started >= 15
    assert_untouched(cluster, before, watch)


def test_an_etcd_restart_changes_nothing(cluster: Path) -> None:
    before = members(cluster)
    with ReadyWatch(cluster, job_uid(cluster)) as watch:
        ok(cdsim(cluster, "fault", "restart-etcd"))
        ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "30"))
    assert_untouched(cluster, before, watch)


def test_a_controller_failover_changes_nothing(cluster: Path) -> None:
    before = members(cluster)
    with ReadyWatch(cluster, job_uid(cluster)) as watch:
        ok(cdsim(cluster, "fault", "kill-controller", "0"))
        ok(cdsim(cluster, "fault", "kill-controller", "1"))
        # A new domain gets a status only from a live leader: the failover completed.
        ok(cdsim(cluster, "job", "submit", "probe", "--nodes", "1", "--wait", "--timeout", "60"))
        ok(cdsim(cluster, "job", "delete", "probe", "--wait", "--timeout", "60"))
    assert_untouched(cluster, before, watch)


def test_a_killed_node_is_reported_lost_and_takes_its_index_back(cluster: Path) -> None:
    before = members(cluster)
    victim, *peers = job_nodes(cluster)
    killed_at = time.monotonic()
    ok(cdsim(cluster, "fault", "kill-node", victim, "--down-for", "15"))
    out = ok(
        cdsim(cluster, "job", "wait", JOB, "--status", "NotReady", "--reason", "NodeLost", "--timeout", "15")
    )
    assert time.monotonic() - killed_at <= NODE_LOST_WITHIN_S + 2, out  # + the cdsim call itself
    domain = next(d for d in status(cluster)["domains"] if d["name"] == JOB)
    assert victim in domain["message"]
    during = members(cluster)
    for peer in peers:  # peers untouched: same index, pid, instance and nodes config
        assert during[peer] == before[peer]
    assert during[victim].index == before[victim].index
    # The peers' imports from each other are intact; only those involving the dead node are not.
    check = cdsim(cluster, "job", "check", JOB)
    assert check.returncode == 1
    assert all(victim in line for line in check.stderr.splitlines()[1:]), check.stderr
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))

    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "90"))
    after = members(cluster)
    assert after[victim].index == before[victim].index, "the returning node got another index"
    assert after[victim].daemon_pid != before[victim].daemon_pid  # it is a new daemon: the node died
    for peer in peers:
        assert after[peer] == before[peer]
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))
