"""The invariant checker passes a consistent domain and names every kind of violation.

Each test starts from the same consistent domain (tests/invariants/rig.py: records in a real
etcd, the IMEX agent's files on disk, live stand-in daemons), shows that it passes, then breaks one
thing and asserts the exact violation. So no detection here can be vacuous.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import betterproto
import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.imex.config import render_nodes_config
from libs.invariants.checker import check_cluster_idle, check_domain_gone, check_inventory
from libs.state.store import Store
from services.imexagent.process import write_pidfile
from tests.invariants.rig import (
    CLIQUE,
    LOST,
    NAMESPACE,
    NON_FABRIC,
    Rig,
    address,
    member,
    new_uid,
    prepared,
    slot_list,
    stand_in,
    stop,
)


@pytest.fixture
async def rig(store: Store, tmp_path: Path) -> AsyncIterator[Rig]:
    built = Rig(store, tmp_path)
    try:
        await built.build()
        assert await built.check() == [], "the consistent domain must pass before anything is broken"
        yield built
    finally:
        built.close()


def only(violations: list[str], prefix: str) -> str:
    """The one violation found; it must start with `prefix`."""
    assert len(violations) == 1, violations
    assert violations[0].startswith(prefix), violations
    return violations[0]


async def test_a_consistent_domain_passes(rig: Rig) -> None:
    # The same rig every other test breaks: running daemons on the 18-slot config, a LOST member
    # keeping its slot's address, a non-fabric member, prepared claims of every member.
    assert len(slots.parse_hosts(rig.hosts("n0").read_text())) == slots.MAX_SLOTS
    assert slots.parse_hosts(rig.hosts("n0").read_text())[slots.slot_name(rig.uid, CLIQUE, 2)] == address(
        LOST
    )
    assert all(p.poll() is None for p in rig.daemons.values())
    assert await rig.check(quiescent=True) == []
    assert await rig.check(quiescent=False) == []


# ----------------------------------------------------------------------- 1: one domain per node


async def test_inv1_a_node_in_two_domains(rig: Rig) -> None:
    other = new_uid()
    await rig.store.put(rig.store.keys.domain(other), pb.ComputeDomain(uid=other, namespace="b", name="b"))
    await rig.store.put(rig.store.keys.member(other, "n1"), member(other, "n1", 0))
    found = only(await rig.check(), "inv1: node n1 is a member of 2 domains")
    assert rig.uid in found and other in found


async def test_inv1_a_binding_that_disagrees_with_the_membership(rig: Rig) -> None:
    other = new_uid()
    await rig.store.put(rig.store.keys.node_binding("n0"), pb.NodeBinding(node_name="n0", domain_uid=other))
    assert (
        only(await rig.check(), "inv1:") == f"inv1: node n0 is bound to {other} but a member of ['{rig.uid}']"
    )


# ----------------------------------------------------------------------- 2: index unique, in range


async def test_inv2_an_index_held_twice_even_by_a_lost_member(rig: Rig) -> None:
    # n4 joins at index 2, which the LOST n2 still holds.
    await rig.store.put(rig.store.keys.member(rig.uid, "n4"), member(rig.uid, "n4", 2))
    found = only(await rig.check(), f"inv2: index 2 of clique {CLIQUE} in {rig.uid}")
    assert found.endswith("held by n2 and n4")


async def test_inv2_two_active_members_on_one_index(rig: Rig) -> None:
    await rig.store.put(rig.store.keys.member(rig.uid, "n4"), member(rig.uid, "n4", 0))
    assert only(await rig.check(), "inv2: index 0").endswith("held by n0 and n4")


@pytest.mark.parametrize("index", [slots.MAX_SLOTS, 40, -1])
async def test_inv2_a_fabric_index_out_of_range(rig: Rig, index: int) -> None:
    await rig.store.put(rig.store.keys.member(rig.uid, "n4"), member(rig.uid, "n4", 0))
    bad = member(rig.uid, "n4", 0)
    bad.index = index
    await rig.store.put(rig.store.keys.member(rig.uid, "n4"), bad)
    assert only(await rig.check(), "inv2:") == (
        f"inv2: member n4 of {rig.uid} has index {index} outside [0, {slots.MAX_SLOTS})"
    )


async def test_inv2_a_non_fabric_member_with_an_index(rig: Rig) -> None:
    bad = member(rig.uid, NON_FABRIC, -1)
    bad.index = 5
    await rig.store.put(rig.store.keys.member(rig.uid, NON_FABRIC), bad)
    assert only(await rig.check(), "inv2:") == f"inv2: non-fabric member n3 of {rig.uid} has index 5"


# ----------------------------------------------------------------------- 3: prepared claims


async def test_inv3_a_claim_prepared_for_a_missing_domain(rig: Rig) -> None:
    gone = new_uid()
    await rig.store.put(rig.store.keys.preparation("n0", "c-gone"), prepared(gone, "n0", "c-gone"))
    # Still being prepared: not yet a claim that "belongs" anywhere.
    starting = prepared(gone, "n1", "c-starting")
    starting.state = pb.PreparedState.PREPARE_STARTED
    await rig.store.put(rig.store.keys.preparation("n1", "c-starting"), starting)
    assert (
        only(await rig.check(), "inv3:") == f"inv3: claim c-gone on n0 is prepared for missing domain {gone}"
    )


async def test_inv3_a_claim_of_another_namespace(rig: Rig) -> None:
    await rig.store.put(rig.store.keys.preparation("n1", "c-x"), prepared(rig.uid, "n1", "c-x", "intruder"))
    assert only(await rig.check(), "inv3:") == (
        f"inv3: claim c-x of namespace intruder is prepared for domain {NAMESPACE}/job-cd"
    )


async def test_inv3_a_claim_prepared_on_a_node_that_is_no_member(rig: Rig) -> None:
    await rig.store.put(rig.store.keys.preparation("n9", "c-y"), prepared(rig.uid, "n9", "c-y"))
    assert (
        only(await rig.check(), "inv3:")
        == f"inv3: claim c-y is prepared on n9, which is not a member of {rig.uid}"
    )


# ----------------------------------------------------------------------- 4: the daemons' slots


async def test_inv4_a_nodes_config_that_is_not_the_slot_list(rig: Rig) -> None:
    # The old way (member addresses), written before the daemon started.
    path = rig.nodes_config("n0")
    path.write_text(render_nodes_config([address("n0"), address("n1")]))
    rig.set_mtime(path, time.time() - 60)
    found = only(await rig.check(quiescent=False), "inv4:")
    assert found == f"inv4: nodes config of n0 in {rig.uid} is not the clique's fixed slot list"
    # Another clique's (or domain's) slot names are not this one's either.
    path.write_text(slots.render_nodes_config_slots(rig.uid, "other-clique.1"))
    rig.set_mtime(path, time.time() - 60)
    assert only(await rig.check(), "inv4:") == found


async def test_inv4_a_nodes_config_rewritten_while_its_daemon_runs(rig: Rig) -> None:
    # Same content, but written after the daemon read it: a running daemon never sees a rewrite.
    rig.set_mtime(rig.nodes_config("n1"), time.time() + 2)
    pid = rig.daemons["n1"].pid
    for quiescent in (True, False):  # a rewrite is wrong at any time
        found = only(
            await rig.check(quiescent=quiescent), f"inv4: nodes config of n1 in {rig.uid} was rewritten"
        )
        assert found.endswith(f"after its daemon (pid {pid}) started")


async def test_inv4_a_daemon_without_a_nodes_config(rig: Rig) -> None:
    rig.nodes_config("n0").unlink()
    assert only(await rig.check(quiescent=False), "inv4:") == (
        f"inv4: daemon pid {rig.daemons['n0'].pid} of n0 in {rig.uid} runs without a readable nodes config"
    )


async def test_inv4_a_hosts_file_resolving_a_slot_to_the_wrong_address(rig: Rig) -> None:
    addresses = slot_list(rig.fabric)
    addresses[0] = "127.9.9.9"
    rig.hosts("n1").write_text(slots.render_hosts(addresses, rig.uid, CLIQUE))
    assert only(await rig.check(), "inv4:") == (
        f"inv4: slot resolution of n1 in {rig.uid} is wrong: slot 0 -> 127.9.9.9 (member address {address('n0')})"
    )
    # Peers catch up with a membership change shortly after it: not checked while things move.
    assert await rig.check(quiescent=False) == []


async def test_inv4_a_lost_members_slot_keeps_its_address(rig: Rig) -> None:
    # The old behaviour: a lost member's slot emptied (pointed at the placeholder).
    addresses = slot_list(rig.fabric)
    addresses[2] = slots.PLACEHOLDER_ADDRESS
    rig.hosts("n0").write_text(slots.render_hosts(addresses, rig.uid, CLIQUE))
    assert only(await rig.check(), "inv4:") == (
        f"inv4: slot resolution of n0 in {rig.uid} is wrong: "
        f"slot 2 -> {slots.PLACEHOLDER_ADDRESS} (member address {address(LOST)})"
    )


async def test_inv4_a_hosts_file_missing_a_slot(rig: Rig) -> None:
    name = slots.slot_name(rig.uid, CLIQUE, 17)
    text = rig.hosts("n0").read_text()
    rig.hosts("n0").write_text("".join(line for line in text.splitlines(True) if name not in line))
    assert only(await rig.check(), "inv4:") == (
        f"inv4: slot resolution of n0 in {rig.uid} is wrong: "
        f"slot 17 -> unresolved (member address {slots.PLACEHOLDER_ADDRESS})"
    )
    rig.hosts("n0").unlink()
    assert (
        only(await rig.check(), "inv4:") == f"inv4: n0 in {rig.uid} has no readable hosts file for its slots"
    )


async def test_inv4_a_daemon_reporting_wrong_slot_addresses(rig: Rig) -> None:
    reported = slot_list(rig.fabric)
    reported[2] = slots.PLACEHOLDER_ADDRESS
    await rig.put_status("n1", reported)
    found = only(await rig.check(), f"inv4: daemon of n1 in {rig.uid} reports slot addresses")
    assert f"'{slots.PLACEHOLDER_ADDRESS}'" in found and f"members hold {slot_list(rig.fabric)}" in found
    assert await rig.check(quiescent=False) == []


async def test_inv4_files_of_no_running_daemon_are_not_its_config(rig: Rig) -> None:
    """A pidfile naming an exited process, or a reused pid, is no daemon: nothing runs on the files."""
    stop(rig.daemons["n0"])
    rig.nodes_config("n0").write_text("garbage\n")
    assert await rig.check(quiescent=False) == []
    impostor = stand_in()
    rig.others.append(impostor)
    (rig.dir("n0") / "daemon.pid").write_text(json.dumps({"pid": impostor.pid, "start_ticks": 1}))
    assert await rig.check(quiescent=False) == []
    write_pidfile(rig.dir("n0"), impostor.pid)  # now it is the recorded process
    assert only(await rig.check(quiescent=False), "inv4:").startswith("inv4: nodes config of n0")


# ----------------------------------------------------------------------- 5: nothing left


@pytest.fixture
async def deleted(rig: Rig) -> Rig:
    """The rig's domain torn down completely (the consistent "after deletion" state)."""
    await rig.tear_down()
    assert await check_domain_gone(rig.store, rig.uid, ["claim-n0"], rig.nodes) == []
    assert await check_cluster_idle(rig.store, rig.nodes) == []
    return rig


async def gone(rig: Rig) -> list[str]:
    return await check_domain_gone(rig.store, rig.uid, ["claim-n0"], rig.nodes)


RECORDS = [
    "domain",
    "member",
    "index claim",
    "daemon status",
    "node binding",
    "prepared claim",
    "claim",
    "mesh CA",
    "mesh certificate request",
    "mesh certificate",
]


async def plant_record(rig: Rig, what: str) -> str:
    """Put back one record of the deleted domain; its key."""
    k, uid = rig.store.keys, rig.uid
    planted: dict[str, tuple[str, betterproto.Message]] = {
        "domain": (k.domain(uid), pb.ComputeDomain(uid=uid, namespace=NAMESPACE, name="job-cd")),
        "member": (k.member(uid, "n1"), member(uid, "n1", 1)),
        "index claim": (
            k.member_index(uid, CLIQUE, 1),
            pb.IndexClaim(domain_uid=uid, clique_id=CLIQUE, index=1),
        ),
        "daemon status": (k.daemon(uid, "n1"), pb.DaemonStatus(domain_uid=uid, node_name="n1")),
        "node binding": (k.node_binding("n1"), pb.NodeBinding(node_name="n1", domain_uid=uid)),
        "prepared claim": (k.preparation("n1", "claim-n1"), prepared(uid, "n1", "claim-n1")),
        "claim": (
            k.claim("claim-n0"),
            pb.Claim(uid="claim-n0", namespace=NAMESPACE, name="c", node_name="n0"),
        ),
        "mesh CA": (k.mesh_authority(uid), pb.MeshAuthority(domain_uid=uid, ca_cert_pem=b"x")),
        "mesh certificate request": (
            k.mesh_request(uid, "n1"),
            pb.MeshCertificateRequest(domain_uid=uid, node_name="n1", csr_pem=b"x"),
        ),
        "mesh certificate": (
            k.mesh_certificate(uid, "n1"),
            pb.MeshCertificate(domain_uid=uid, node_name="n1", cert_pem=b"x"),
        ),
    }
    key, value = planted[what]
    await rig.store.put(key, value)
    return key


@pytest.mark.parametrize("what", RECORDS)
async def test_inv5_a_record_left_behind(deleted: Rig, what: str) -> None:
    key = await plant_record(deleted, what)
    expected = {
        "domain": f"inv5: domain record {deleted.uid} remains",
        "claim": "inv5: claim record claim-n0 remains",
    }.get(what, f"inv5: {what} {key} remains")
    assert only(await gone(deleted), "inv5:") == expected
    assert (
        only(await check_cluster_idle(deleted.store, deleted.nodes), "idle:") == f"idle: {what} {key} remains"
    )


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
async def test_inv5_a_cdi_spec_left_behind(deleted: Rig, suffix: str) -> None:
    name = f"k8s.compute-domain.nvidia.com-claim_claim-n0{suffix}"
    (deleted.paths("n0").cdi_root / name).write_text("{}")
    (deleted.paths("n1").cdi_root / "k8s.compute-domain.nvidia.com-claim_other.json").write_text("{}")
    assert only(await gone(deleted), "inv5:") == f"inv5: CDI file {name} remains on n0"
    idle = await check_cluster_idle(deleted.store, deleted.nodes)
    assert sorted(idle) == [
        f"idle: CDI file {name} remains on n0",
        "idle: CDI file k8s.compute-domain.nvidia.com-claim_other.json remains on n1",
    ]


async def test_inv5_an_imex_directory_left_behind(deleted: Rig) -> None:
    deleted.dir("n1").mkdir()
    assert only(await gone(deleted), "inv5:") == f"inv5: IMEX config dir for {deleted.uid} remains on n1"
    assert only(await check_cluster_idle(deleted.store, deleted.nodes), "idle:") == (
        f"idle: IMEX dir {deleted.uid} remains on n1"
    )


async def test_inv5_a_process_left_behind(deleted: Rig) -> None:
    orphan = stand_in(str(deleted.dir("n0") / "config.cfg"))
    deleted.others.append(orphan)
    assert only(await gone(deleted), "inv5:") == f"inv5: processes [{orphan.pid}] still run for {deleted.uid}"
    stop(orphan)
    assert await gone(deleted) == []


async def test_idle_an_imex_daemon_left_behind(deleted: Rig) -> None:
    # What the idle check looks for: the simulated daemon's script with a config under the IMEX dir.
    orphan = stand_in("run_daemon.py", "-c", str(deleted.paths("n1").imex_work_dir / "x" / "config.cfg"))
    deleted.others.append(orphan)
    assert only(await check_cluster_idle(deleted.store, deleted.nodes), "idle:") == (
        f"idle: IMEX daemon pid {orphan.pid} still runs on n1"
    )


@pytest.mark.parametrize("by", ["domain", "claim uid"])
async def test_inv5_a_checkpoint_entry_left_behind(deleted: Rig, by: str) -> None:
    entry = {"state": "PrepareCompleted", "domainUID": deleted.uid if by == "domain" else "someone-else"}
    uid = "c-left" if by == "domain" else "claim-n0"
    deleted.paths("n0").checkpoint_file.write_text(json.dumps({"entries": {uid: entry}}))
    assert (
        only(await gone(deleted), "inv5:") == f"inv5: checkpoint entry {uid} for {deleted.uid} remains on n0"
    )
    assert only(await check_cluster_idle(deleted.store, deleted.nodes), "idle:") == (
        f"idle: checkpoint entry {uid} remains on n0"
    )


async def test_another_domains_things_are_no_leftover_of_this_one(deleted: Rig) -> None:
    other = new_uid()
    k = deleted.store.keys
    await deleted.store.put(k.member(other, "n0"), member(other, "n0", 0))
    await deleted.store.put(k.node_binding("n0"), pb.NodeBinding(node_name="n0", domain_uid=other))
    await deleted.store.put(k.preparation("n0", "c-o"), prepared(other, "n0", "c-o"))
    (deleted.paths("n0").imex_work_dir / other).mkdir()
    deleted.paths("n0").checkpoint_file.write_text(
        json.dumps({"entries": {"c-o": {"state": "PrepareCompleted", "domainUID": other}}})
    )
    assert await gone(deleted) == []
    assert len(await check_cluster_idle(deleted.store, deleted.nodes)) == 5


async def test_an_empty_cluster_is_idle(store: Store, tmp_path: Path) -> None:
    rig = Rig(store, tmp_path)
    for node in rig.nodes:
        node.cdi_root.mkdir(parents=True)
        node.imex_work_dir.mkdir(parents=True)
    assert await check_cluster_idle(store, rig.nodes) == []
    assert await check_domain_gone(store, "never-existed", ["c1"], rig.nodes) == []


async def test_inv7_a_live_node_missing_or_undecodable_in_the_inventory(store: Store) -> None:
    live = ["tray-a", "tray-b", "tray-c"]
    for name in live:
        await store.put(store.keys.node(name), pb.Node(name=name, clique_id=CLIQUE))
    assert await check_inventory(store, live) == []
    await store.delete(store.keys.node("tray-a"))
    await store.put_raw(store.keys.node("tray-b"), b"\x00\xffnot an envelope")
    assert await check_inventory(store, live) == [
        f"inv7: node {name}'s IMEX agent is alive but its record {store.keys.node(name)} is missing or "
        "undecodable: the advisor does not count the node"
        for name in ("tray-a", "tray-b")
    ]
    # A node whose agent is not running is absent by design (node loss), not a violation.
    assert await check_inventory(store, ["tray-c"]) == []
