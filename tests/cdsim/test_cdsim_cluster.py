"""`cdsim` driven as a user drives it (subprocesses), on a real simulated cluster.

One cluster (2 racks x 4 trays: 8 node agents, 2 controllers, the advisor, etcd) is shared by
the tests of this module, which run in order: up -> bad input -> a 4-node job Ready -> every
fault command, each followed by the invariants and the job Ready again -> delete -> down.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from tests import address_blocks
from tests.cdsim.cli import cdsim, ok, run_state, status
from tests.polling import eventually, wait_until
from tools.cdsim import credentials
from tools.cdsim.jobs import open_store
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes
from tools.cdsim.services import IMEX_AGENT_LEASE_TTL_S

pytestmark = pytest.mark.slow

RACKS, TRAYS = 2, 4
ADDRESS_BLOCK = address_blocks.CDSIM_CLUSTER
JOB = "train"
JOB_NODES = 4


def domain_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in doc["domains"] if d["name"] == name)


def job_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in doc["jobs"] if j["name"] == name)


def assert_invariants(state_dir: Path) -> None:
    assert "invariants 1-4 hold" in ok(cdsim(state_dir, "check"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    # Short, so the nodes' unix socket paths stay under 108 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-t"))
    try:
        result = cdsim(
            state_dir,
            "up",
            "--racks",
            str(RACKS),
            "--trays",
            str(TRAYS),
            "--address-block",
            str(ADDRESS_BLOCK),
        )
        ok(result)
        yield state_dir
    finally:
        cdsim(state_dir, "down", timeout=90)
        leftovers = cluster_processes(StateLayout.at(state_dir))
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leftovers, f"processes left running: {leftovers}"


def test_up_starts_every_node_with_its_own_directories(cluster: Path) -> None:
    doc = status(cluster)
    assert doc["phase"] == "ready"
    nodes = doc["nodes"]
    assert [n["name"] for n in nodes] == [f"rack{r}-tray{t}" for r in range(RACKS) for t in range(TRAYS)]
    assert all(n["registered"] and n["agent_running"] for n in nodes)
    assert len({n["address"] for n in nodes}) == len(nodes)
    assert {n["address"].split(".")[1] for n in nodes} == {str(ADDRESS_BLOCK)}
    # One clique per rack.
    cliques = {n["rack"]: {m["clique"] for m in nodes if m["rack"] == n["rack"]} for n in nodes}
    assert (
        all(len(c) == 1 for c in cliques.values()) and len({next(iter(c)) for c in cliques.values()}) == RACKS
    )
    for node in nodes:
        assert (Path(node["kubelet_dir"]) / "plugins" / "compute-domain.nvidia.com" / "dra.sock").is_socket()
        assert Path(node["cdi_dir"]).is_dir()
    kinds = sorted(p["kind"] for p in doc["processes"])
    assert (
        kinds.count("controller") == 2
        and kinds.count("advisor") == 1
        and kinds.count("agent") == RACKS * TRAYS
    )
    assert all(p["healthy"] for p in doc["processes"])


def test_up_twice_is_refused_and_changes_nothing(cluster: Path) -> None:
    before = status(cluster)
    result = cdsim(cluster, "up", "--racks", "1")
    assert result.returncode == 1
    assert "already running" in result.stderr
    after = status(cluster)
    assert [p["pid"] for p in after["processes"]] == [p["pid"] for p in before["processes"]]
    assert len(after["nodes"]) == RACKS * TRAYS


def test_a_second_cluster_on_the_same_addresses_is_refused(cluster: Path) -> None:
    other = Path(tempfile.mkdtemp(prefix="cdsim-t"))
    try:
        result = cdsim(other, "up", "--racks", "1", "--trays", "2", "--address-block", str(ADDRESS_BLOCK))
        assert result.returncode == 1
        assert f"address block {ADDRESS_BLOCK}" in result.stderr
        assert cluster_processes(StateLayout.at(other)) == []
    finally:
        shutil.rmtree(other, ignore_errors=True)
    assert status(cluster)["phase"] == "ready"


def test_a_job_larger_than_free_capacity_is_refused_with_the_advisors_reason(cluster: Path) -> None:
    # A rack has 4 trays: 5 nodes cannot be in one NVLink clique.
    result = cdsim(cluster, "job", "submit", "too-big", "--nodes", str(TRAYS + 1))
    assert result.returncode == 1
    assert "placement advisor says" in result.stderr and "Nothing was created" in result.stderr
    # Larger than the whole cluster.
    result = cdsim(cluster, "job", "submit", "way-too-big", "--nodes", "100")
    assert result.returncode == 1
    assert f"--nodes 100: the cluster has {RACKS * TRAYS} nodes" in result.stderr
    doc = status(cluster)
    assert doc["domains"] == [] and doc["jobs"] == []


def test_submit_prepares_every_claim_and_the_domain_becomes_ready(cluster: Path) -> None:
    out = ok(cdsim(cluster, "job", "submit", JOB, "--nodes", str(JOB_NODES), "--wait"))
    assert f"{JOB_NODES}/{JOB_NODES} claims prepared" in out
    assert "ComputeDomain status: Ready" in out
    doc = status(cluster)
    domain = domain_of(doc, JOB)
    assert domain["status"] == "Ready"
    assert sorted(n["index"] for n in domain["nodes"]) == list(range(JOB_NODES))
    job = job_of(doc, JOB)
    assert job["domain_uid"] == domain["uid"]
    assert len({c["node"] for c in job["claims"]}) == JOB_NODES
    nodes = {n["name"]: n for n in doc["nodes"]}
    for claim in job["claims"]:
        cdi = Path(nodes[claim["node"]]["cdi_dir"])
        assert list(cdi.glob(f"*claim_{claim['uid']}.*")), (
            f"no CDI spec for {claim['uid']} on {claim['node']}"
        )
        assert nodes[claim["node"]]["domain"] == domain["uid"]
    # All in one rack (one clique).
    assert len({nodes[c["node"]]["rack"] for c in job["claims"]}) == 1
    assert_invariants(cluster)


def test_submitting_the_same_job_again_is_refused(cluster: Path) -> None:
    result = cdsim(cluster, "job", "submit", JOB, "--nodes", "1")
    assert result.returncode == 1 and "exists already" in result.stderr


def test_fault_kill_agent_restarts_the_plugin_and_changes_nothing(cluster: Path) -> None:
    """The kubelet plugin holds no lease and runs no daemon: its job's domain does not notice."""
    doc = status(cluster)
    victim = job_of(doc, JOB)["claims"][1]["node"]
    old_pid = next(n["agent_pid"] for n in doc["nodes"] if n["name"] == victim)
    members_before = domain_of(doc, JOB)["nodes"]
    out = ok(cdsim(cluster, "fault", "kill-agent", victim, "--down-for", "3"))
    assert f"pid {old_pid}" in out

    def restarted() -> bool:
        node = next(n for n in status(cluster)["nodes"] if n["name"] == victim)
        return bool(node["agent_running"]) and node["agent_pid"] not in (0, old_pid)

    wait_until(restarted, f"the plugin of {victim} to be started again", 60)
    after = status(cluster)
    assert domain_of(after, JOB)["status"] == "Ready"
    assert domain_of(after, JOB)["nodes"] == members_before  # same indices, states, daemon pids
    assert_invariants(cluster)


def test_fault_kill_node_is_reported_as_node_lost_and_recovers(cluster: Path) -> None:
    doc = status(cluster)
    victim = job_of(doc, JOB)["claims"][1]["node"]
    index = next(n["index"] for n in domain_of(doc, JOB)["nodes"] if n["name"] == victim)
    ok(cdsim(cluster, "fault", "kill-node", victim, "--down-for", "20"))
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "NotReady", "--reason", "NodeLost", "--timeout", "30"))
    lost = domain_of(status(cluster), JOB)
    assert victim in lost["message"]
    assert_invariants(cluster)
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "60"))
    after = status(cluster)
    node = next(n for n in after["nodes"] if n["name"] == victim)
    assert node["agent_running"] and node["imex_agent_running"]
    assert next(n["index"] for n in domain_of(after, JOB)["nodes"] if n["name"] == victim) == index
    assert sorted(n["index"] for n in domain_of(after, JOB)["nodes"]) == list(range(JOB_NODES))
    assert_invariants(cluster)


def _imex_pids(state_dir: Path, node: str) -> list[int]:
    from tools.cdsim.proc_scan import imex_daemons_under

    return [p.pid for p in imex_daemons_under(StateLayout.at(state_dir).node(node).imex_dir)]


def test_fault_kill_imex_restarts_the_daemon(cluster: Path) -> None:
    victim = job_of(status(cluster), JOB)["claims"][2]["node"]
    before = _imex_pids(cluster, victim)
    assert len(before) == 1
    ok(cdsim(cluster, "fault", "kill-imex", victim))

    def restarted() -> bool:
        now = _imex_pids(cluster, victim)
        return bool(now) and now != before

    wait_until(restarted, f"the IMEX daemon of {victim} to be restarted", 30)
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "30"))
    assert_invariants(cluster)


def test_fault_kill_controller_the_other_replica_keeps_reconciling(cluster: Path) -> None:
    ok(cdsim(cluster, "fault", "kill-controller", "0"))
    # Status of a new domain is only computed by a live controller: the standby took over.
    ok(cdsim(cluster, "job", "submit", "small", "--nodes", "2", "--wait", "--timeout", "60"))
    ok(cdsim(cluster, "fault", "kill-controller", "1"))
    ok(cdsim(cluster, "job", "delete", "small", "--wait", "--timeout", "60"))
    doc = status(cluster)
    assert [d["name"] for d in doc["domains"]] == [JOB]
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "30"))
    assert_invariants(cluster)
    result = cdsim(cluster, "fault", "kill-controller", "5")
    assert result.returncode == 1 and "no controller replica 5" in result.stderr


def test_fault_restart_etcd_keeps_the_job(cluster: Path) -> None:
    out = ok(cdsim(cluster, "fault", "restart-etcd"))
    assert "etcd stopped and started again" in out
    ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "60"))
    doc = status(cluster)
    assert len(domain_of(doc, JOB)["nodes"]) == JOB_NODES
    assert_invariants(cluster)


def test_a_node_record_deleted_or_garbled_by_hand_comes_back_and_counts_again(cluster: Path) -> None:
    """An operator's `etcdctl del` or a garbled value: the node's IMEX agent writes its record
    again within a lease period, and the advisor places on the node again."""
    doc = status(cluster)
    busy = {n["name"] for n in domain_of(doc, JOB)["nodes"]}
    free = [n["name"] for n in doc["nodes"] if n["name"] not in busy]
    assert len(free) == TRAYS  # the other rack: one clique

    async def damage_and_wait() -> list[float]:
        state = run_state(cluster)
        took = []
        async with open_store(state) as store:
            for victim, damage in zip(free, ("delete", "garbage"), strict=False):
                key = store.keys.node(victim)
                if damage == "delete":
                    assert await store.delete(key)
                else:
                    await store.put_raw(key, b"\xff garbled by hand")

                async def rewritten(key: str = key) -> bool:
                    item = await store.get(key, pb.Node)
                    return item is not None and item.lease != 0

                began = time.monotonic()
                # Fine polling: the time it took is the measurement.
                await eventually(
                    rewritten, f"{victim}'s record after {damage}", IMEX_AGENT_LEASE_TTL_S, max_delay_s=0.05
                )
                took.append(time.monotonic() - began)
            host, port = state.advisor_endpoint.rsplit(":", 1)
            channel = Channel(host, int(port), ssl=credentials.advisor_tls(state))
            try:
                stub = pp.PlacementAdvisorStub(channel, timeout=10)
                for _ in range(50):  # the advisor's view follows the store within moments
                    placed = await stub.place(pp.PlaceRequest(num_nodes=TRAYS, dry_run=True))
                    if placed.feasible:
                        break
                    await asyncio.sleep(0.1)
                assert placed.feasible and sorted(placed.placements[0].node_names) == sorted(free)
            finally:
                channel.close()
        return took

    took = asyncio.run(damage_and_wait())
    assert all(t < IMEX_AGENT_LEASE_TTL_S for t in took), took
    assert_invariants(cluster)


def test_fault_on_an_unknown_node_is_refused(cluster: Path) -> None:
    result = cdsim(cluster, "fault", "kill-agent", "rack9-tray0")
    assert result.returncode == 1 and "no node rack9-tray0" in result.stderr
    result = cdsim(cluster, "fault", "kill-imex", f"rack1-tray{TRAYS - 1}")
    assert result.returncode == 1 and "no IMEX daemon runs" in result.stderr


def test_delete_leaves_nothing_behind(cluster: Path) -> None:
    doc = status(cluster)
    job = job_of(doc, JOB)
    ok(cdsim(cluster, "job", "delete", JOB, "--wait"))
    out = ok(cdsim(cluster, "check", "--idle"))
    assert "nothing of any domain is left" in out
    doc = status(cluster)
    assert doc["domains"] == [] and doc["jobs"] == []
    nodes = {n["name"]: n for n in doc["nodes"]}
    for claim in job["claims"]:
        assert not list(Path(nodes[claim["node"]]["cdi_dir"]).glob("*claim_*"))
        assert _imex_pids(cluster, claim["node"]) == []
    result = cdsim(cluster, "job", "delete", JOB)
    assert result.returncode == 1 and "no job default/train" in result.stderr
    # A leftover file is found.
    stray = (
        Path(nodes[job["claims"][0]["node"]]["cdi_dir"])
        / f"k8s.compute-domain.nvidia.com-claim_{job['claims'][0]['uid']}.json"
    )
    stray.write_text("{}")
    result = cdsim(cluster, "check", "--idle", "--settle", "0")
    stray.unlink()
    assert result.returncode == 1 and f"idle: CDI file {stray.name} remains" in result.stderr


def test_down_stops_everything_and_is_idempotent(cluster: Path) -> None:
    layout = StateLayout.at(cluster)
    assert cluster_processes(layout)
    out = ok(cdsim(cluster, "down", timeout=90))
    assert "stopped" in out
    assert cluster_processes(layout) == []
    out = ok(cdsim(cluster, "down"))
    assert "nothing to stop" in out
    result = cdsim(cluster, "status")
    assert result.returncode == 1 and "cdsim up" in result.stderr


def test_down_cleans_up_after_a_crashed_supervisor() -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-t"))
    layout = StateLayout.at(state_dir)
    try:
        ok(cdsim(state_dir, "up", "--racks", "1", "--trays", "2", "--address-block", str(ADDRESS_BLOCK + 1)))
        supervisor = json.loads(layout.run_file.read_text())["supervisor_pid"]
        os.kill(supervisor, signal.SIGKILL)
        out = ok(cdsim(state_dir, "down", timeout=90))
        assert "nothing to stop" in out or "leftover" in out
        wait_until(
            lambda: cluster_processes(layout) == [],
            "the cluster's processes to end",
            10,
            explain=lambda: f"still running: {cluster_processes(layout)}",
        )
        # The state dir is usable again.
        ok(cdsim(state_dir, "up", "--racks", "1", "--trays", "2", "--address-block", str(ADDRESS_BLOCK + 1)))
        ok(cdsim(state_dir, "down", timeout=90))
        assert cluster_processes(layout) == []
    finally:
        cdsim(state_dir, "down", timeout=90)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_down_with_nothing_running_succeeds(tmp_path: Path) -> None:
    out = ok(cdsim(tmp_path, "down"))
    assert "No cdsim cluster is running" in out
