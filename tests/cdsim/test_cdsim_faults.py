"""A node cut off etcd (`cdsim fault partition-etcd`) and a job that grows (`cdsim job scale`).

The etcd gate and the import planning are tested on their own first; then one real cdsim cluster
(1 rack x 6 trays) runs a 2-node job: one member is partitioned from etcd for a few seconds (its
node record lapses, the domain stays Ready throughout, nothing of the job changes), then the job
grows to 4 nodes (the existing members keep their daemons, instances and imports; the new ones
take free indices; `job check` expects the full set) and shrinks back to 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.imex import config as imexcfg
from tests import address_blocks
from tests.cdsim.cli import ReadyWatch, cdsim, daemon_instances, ok, run_state, status
from tests.polling import eventually, wait_until
from tools.cdsim.etcd_gate import EtcdGate
from tools.cdsim.job_book import Importer
from tools.cdsim.jobs import open_store
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes
from tools.cdsim.workload import missing_pairs
from tools.net_ports import free_port
from tools.sim.imex import client as simclient

TRAYS = 6
ADDRESS_BLOCK = address_blocks.CDSIM_FAULTS
JOB = "grow"
PARTITION_S = 30.0  # as long as the outage a running job must not notice
CUT_S = 20.0  # IMEX links cut: past the daemons' heartbeat timeout, short of the grace time


# ---- the gate on its own ---------------------------------------------------------------------


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _round_trip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 5)
    finally:
        writer.close()


async def test_the_gate_forwards_cuts_and_resumes_by_itself() -> None:
    server, target = await _echo_server()
    gate = EtcdGate("n", free_port(), target)
    await gate.start()
    try:
        big = bytes(range(256)) * 4096  # 1 MiB: more than one read, flow-controlled both ways
        assert await _round_trip(gate.port, big) == big
        reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(b"open")
        assert await reader.readexactly(4) == b"open"

        assert gate.partition(0.5) == 2  # both legs of the one open connection
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 5)  # the open connection is reset
        writer.close()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _round_trip(gate.port, b"during")  # new ones are dropped
        assert gate.dropped >= 1

        await eventually(lambda: not gate.partitioned, "the partition to heal", 5)
        assert await _round_trip(gate.port, b"after") == b"after"
    finally:
        await gate.close()
        server.close()


async def test_a_gate_reaches_a_restarted_target_on_the_same_port() -> None:
    server, target = await _echo_server()
    gate = EtcdGate("n", free_port(), target)
    await gate.start()
    try:
        assert await _round_trip(gate.port, b"one") == b"one"
        server.close()
        await server.wait_closed()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _round_trip(gate.port, b"down")  # target down: the client is dropped, not hung
        server = await asyncio.start_server(
            lambda r, w: _echo_once(r, w), "127.0.0.1", target, reuse_address=True
        )
        assert await _round_trip(gate.port, b"two") == b"two"
    finally:
        await gate.close()
        server.close()


async def _echo_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(await reader.read(65536))
    await writer.drain()
    writer.close()


# ---- which imports a grown job makes (pure) ----------------------------------------------------

_importers = st.lists(
    st.tuples(st.sampled_from("abcdef"), st.frozensets(st.integers(0, 17), max_size=6)),
    max_size=6,
    unique_by=lambda t: t[0],
).map(lambda xs: [Importer(n, f"addr-{n}", tuple(sorted(s))) for n, s in xs])


@given(_importers, _importers)
def test_only_the_pairs_not_made_before_are_imported(wanted: list[Importer], done: list[Importer]) -> None:
    missing = missing_pairs(wanted, done)
    made = {(i.node, s) for i in done for s in i.sources}
    want = {(i.node, s) for i in wanted for s in i.sources}
    assert {(i.node, s) for i, s in missing} == want - made
    assert len(missing) == len(want - made)  # each pair once


# ---- on a real cluster -------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    index: int
    daemon_pid: int
    instance: str


def job_doc(state_dir: Path) -> dict[str, Any]:
    return dict(next(j for j in status(state_dir)["jobs"] if j["name"] == JOB))


def members(state_dir: Path) -> dict[str, Member]:
    doc = status(state_dir)
    domain = next(d for d in doc["domains"] if d["name"] == JOB)
    instances = asyncio.run(daemon_instances(state_dir, domain["uid"]))
    return {n["name"]: Member(n["index"], n["daemon_pid"], instances[n["name"]]) for n in domain["nodes"]}


def imports_of(state_dir: Path, nodes: list[str]) -> dict[str, set[tuple[int, str, bool]]]:
    """What each node's daemon lists for the job: (exporter node ID, exporter instance, valid)."""
    addresses = {n["name"]: n["address"] for n in status(state_dir)["nodes"]}

    async def one(node: str) -> set[tuple[int, str, bool]]:
        found = await simclient.list_imports(addresses[node], imexcfg.DEFAULT_CMD_PORT, timeout_s=5)
        return {(i.node_id, i.instance, i.valid) for i in found if i.job == JOB}

    async def every() -> list[set[tuple[int, str, bool]]]:
        return list(await asyncio.gather(*(one(n) for n in nodes)))

    return dict(zip(nodes, asyncio.run(every()), strict=True))


def import_log_lines(state_dir: Path, uid: str, node: str) -> list[str]:
    log = StateLayout.at(state_dir).node(node).imex_dir / uid / "nvidia-imex.log"
    return [line for line in log.read_text().splitlines() if f"Job {JOB} imported memory" in line]


async def _node_record_present(state_dir: Path, node: str) -> bool:
    async with open_store(run_state(state_dir)) as store:
        return await store.get(store.keys.node(node), pb.Node) is not None


def wait_node_record(state_dir: Path, node: str, present: bool, timeout_s: float) -> float:
    """Until the node's record is there (or gone); returns when that was seen (monotonic)."""
    wait_until(
        lambda: asyncio.run(_node_record_present(state_dir, node)) == present,
        f"the node record of {node} to be {'there' if present else 'gone'}",
        timeout_s,
        first_delay_s=0.2,
        max_delay_s=0.2,
    )
    return time.monotonic()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-f"))
    try:
        ok(
            cdsim(
                state_dir, "up", "--racks", "1", "--trays", str(TRAYS), "--address-block", str(ADDRESS_BLOCK)
            )
        )
        out = ok(cdsim(state_dir, "job", "submit", JOB, "--nodes", "2", "--wait"))
        assert "workload imported memory" in out
        yield state_dir
    finally:
        cdsim(state_dir, "down", timeout=90)
        leftovers = cluster_processes(StateLayout.at(state_dir))
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leftovers, f"processes left running: {leftovers}"


@pytest.mark.slow
def test_a_member_cut_off_etcd_loses_its_record_but_the_job_stays_ready(cluster: Path) -> None:
    before = members(cluster)
    victim = sorted(before)[0]
    uid = job_doc(cluster)["domain_uid"]
    with ReadyWatch(cluster, uid) as watch:
        started = time.monotonic()
        out = ok(cdsim(cluster, "fault", "partition-etcd", victim, "--down-for", str(PARTITION_S)))
        assert "not lost while its peers report it connected" in out
        # The lease lapses: the record goes (TTL 5 s) while the partition lasts ...
        gone_at = wait_node_record(cluster, victim, present=False, timeout_s=PARTITION_S)
        assert gone_at - started < PARTITION_S
        # ... and comes back by itself once the gate forwards again.
        back_at = wait_node_record(cluster, victim, present=True, timeout_s=PARTITION_S + 30)
        assert back_at - started >= PARTITION_S
        ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", "30"))
    assert watch.seen, "the watch saw no domain record"
    assert watch.not_ready() == [], f"the domain left Ready during the partition: {watch.not_ready()}"
    assert members(cluster) == before, "an index, daemon pid or instance changed"
    assert "all 2 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))


@pytest.mark.slow
def test_a_partition_of_an_unknown_node_is_refused(cluster: Path) -> None:
    result = cdsim(cluster, "fault", "partition-etcd", "rack9-tray0", "--down-for", "3")
    assert result.returncode == 1 and "rack9-tray0" in result.stderr


@pytest.mark.slow
def test_a_member_whose_links_are_cut_is_peer_unreachable_and_keeps_its_imports(cluster: Path) -> None:
    """Past the daemons' heartbeat timeout (15 s), well short of the agent's grace time (600 s)."""
    before = members(cluster)
    victim = sorted(before)[1]
    uid = job_doc(cluster)["domain_uid"]
    with ReadyWatch(cluster, uid) as watch:
        out = ok(cdsim(cluster, "fault", "cut-links", victim, "--for", str(CUT_S)))
        assert "PeerUnreachable (not NodeLost)" in out
        ok(
            cdsim(
                cluster,
                "job",
                "wait",
                JOB,
                "--status",
                "NotReady",
                "--reason",
                "PeerUnreachable",
                "--timeout",
                "30",
            )
        )
        ok(cdsim(cluster, "job", "wait", JOB, "--status", "Ready", "--timeout", str(CUT_S + 30)))
    reasons = {reason for _, _, reason in watch.seen}
    assert "PeerUnreachable" in reasons and "NodeLost" not in reasons, watch.seen
    assert members(cluster) == before, "an index, daemon pid or instance changed"
    assert "all 2 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))


@pytest.mark.slow
def test_a_grown_job_keeps_its_members_and_imports_and_the_new_ones_import_both_ways(cluster: Path) -> None:
    uid = job_doc(cluster)["domain_uid"]
    before = members(cluster)
    old_nodes = sorted(before)
    old_imports = imports_of(cluster, old_nodes)
    assert all(len(found) == 1 and all(valid for _, _, valid in found) for found in old_imports.values())

    out = ok(cdsim(cluster, "job", "scale", JOB, "--nodes", "4"))
    assert "runs on 4 nodes" in out

    after = members(cluster)
    assert len(after) == 4
    for node in old_nodes:
        assert after[node] == before[node], f"{node}: index, daemon pid or instance changed"
    new_nodes = sorted(set(after) - set(before))
    new_indices = {after[n].index for n in new_nodes}
    assert len(new_indices) == 2 and not new_indices & {m.index for m in before.values()}
    assert all(0 <= i < 18 for i in new_indices)
    cliques = {n["clique"] for n in status(cluster)["nodes"] if n["name"] in after}
    assert len(cliques) == 1, "the job left its clique"

    now = imports_of(cluster, sorted(after))
    for node in old_nodes:
        assert old_imports[node] <= now[node], f"{node} lost or changed an import it had"
        # Made once: importing again would renew the entry and hide a lost exporter.
        assert len(import_log_lines(cluster, uid, node)) == 3
    for node, found in now.items():
        others = {m.index for n, m in after.items() if n != node}
        assert {node_id for node_id, _, valid in found if valid} == others, node
    assert "all 12 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    # The new claims come after the old ones: a shrink lets the last added go first.
    assert {c["node"] for c in job_doc(cluster)["claims"][2:]} == set(new_nodes)
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))


@pytest.mark.slow
def test_a_shrunk_job_lets_its_last_node_go_and_keeps_the_rest(cluster: Path) -> None:
    before = members(cluster)
    last = job_doc(cluster)["claims"][-1]["node"]
    out = ok(cdsim(cluster, "job", "scale", JOB, "--nodes", "3"))
    assert "runs on 3 nodes" in out
    after = members(cluster)
    assert set(after) == set(before) - {last}
    assert all(after[n] == before[n] for n in after)
    assert "all 6 imports valid" in ok(cdsim(cluster, "job", "check", JOB))
    assert "invariants 1-4 hold" in ok(cdsim(cluster, "check"))
