"""cdctl: tables, JSON and `describe domain` explanations, from records in a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.cdctl.describe import describe_domain, reasons_not_ready
from tools.cdctl.snapshot import Snapshot
from tools.cdctl.views import BUILDERS, format_table

NOW = 1_800_000_000_000
CLIQUE = "5577f4b2-9410-5b03-97cf-0e823ba536d7.27634"
UID = "11111111-2222-3333-4444-555555555555"


def _node(name: str, address: str) -> pb.Node:
    return pb.Node(
        name=name,
        ip_address=address,
        clique_id=CLIQUE,
        health=pb.Health.HEALTHY,
        gpus=[pb.Gpu(uuid=f"GPU-{name}-{i}", index=i) for i in range(4)],
        registered_unix_ms=NOW - 60_000,
        agent_version="0.1.0",
    )


def _params(uid: str) -> str:
    return json.dumps(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": uid,
            "allocationMode": "Single",
        }
    )


def sample(lost_node: bool = False, failed_daemon: bool = False, num_nodes: int = 3) -> Snapshot:
    """A 3-node domain (rack0-tray0..2) on 4 registered nodes, optionally broken."""
    names = ["rack0-tray0", "rack0-tray1", "rack0-tray2"]
    nodes = [_node(n, f"127.1.0.{i + 1}") for i, n in enumerate([*names, "rack0-tray3"])]
    members = [
        pb.Member(
            domain_uid=UID,
            node_name=n,
            clique_id=CLIQUE,
            index=i,
            state=pb.MemberState.ACTIVE,
            ip_address=f"127.1.0.{i + 1}",
            joined_unix_ms=NOW - 30_000,
            namespace="team-a",
        )
        for i, n in enumerate(names)
    ]
    daemons = [
        pb.DaemonStatus(
            domain_uid=UID,
            node_name=n,
            state=pb.DaemonState.READY,
            pid=100 + i,
            peers=[m.ip_address for m in members],
            updated_unix_ms=NOW - 20_000,
        )
        for i, n in enumerate(names)
    ]
    ready = not (lost_node or failed_daemon) and num_nodes <= len(names)
    reason = "AllNodesReady" if ready else ("NodeLost" if lost_node else "ImexDaemonFailed")
    if lost_node:
        nodes = [n for n in nodes if n.name != "rack0-tray1"]
        members[1].state = pb.MemberState.LOST
        members[1].index = -1
    if failed_daemon:
        daemons[2].state = pb.DaemonState.FAILED
        daemons[2].restarts = 4
        daemons[2].last_error = "exited with code 1"
        daemons[2].last_log_lines = ["bind 127.1.0.3:50000 failed", "address already in use"]
    domain = pb.ComputeDomain(
        uid=UID,
        namespace="team-a",
        name="train",
        spec=pb.ComputeDomainSpec(
            num_nodes=num_nodes, channel=pb.ChannelSpec(resource_claim_template_name="train-ch")
        ),
        status=pb.ComputeDomainStatus(
            status=pb.Readiness.READY if ready else pb.Readiness.NOT_READY,
            nodes=[
                pb.NodeStatus(
                    name=m.node_name,
                    ip_address=m.ip_address,
                    clique_id=CLIQUE,
                    index=m.index,
                    status=pb.Readiness.READY,
                )
                for m in members
            ],
            conditions=[
                pb.Condition(
                    type="Ready",
                    status="True" if ready else "False",
                    reason=reason,
                    message="m",
                    last_transition_unix_ms=NOW - 5_000,
                )
            ],
        ),
        created_unix_ms=NOW - 90_000,
        source="simulation",
    )
    claims = [
        pb.Claim(
            uid=f"claim-{i}",
            namespace="team-a",
            name=f"train-{i}",
            node_name=n,
            config=[pb.OpaqueConfig(driver="compute-domain.nvidia.com", parameters_json=_params(UID))],
        )
        for i, n in enumerate(names)
    ]
    preparations = [
        pb.PreparedClaim(
            claim_uid=f"claim-{i}",
            namespace="team-a",
            node_name=n,
            domain_uid=UID,
            state=pb.PreparedState.PREPARE_COMPLETED,
        )
        for i, n in enumerate(names)
    ]
    return Snapshot(
        domains=[domain],
        members=members,
        nodes=nodes,
        bindings={n: UID for n in names},
        daemons=daemons,
        reservations=[
            pb.Reservation(
                id="r-1",
                node_names=["rack0-tray3"],
                clique_ids=[CLIQUE],
                holder="sched",
                ttl_seconds=30,
                created_unix_ms=NOW - 1000,
            )
        ],
        preparations=preparations,
        claims=claims,
    )


def test_domains_table_shows_readiness_and_reason() -> None:
    view = BUILDERS["domains"](sample(lost_node=True), NOW, None)
    assert view.headers[:6] == ["NAMESPACE", "NAME", "STATUS", "READY", "NUMNODES", "REASON"]
    assert view.rows[0][:6] == ["team-a", "train", "NotReady", "3/3", "3", "NodeLost"]
    assert view.rows[0][6] == "90s"
    assert BUILDERS["domains"](sample(), NOW, "other").rows == []


def test_cliques_count_bound_reserved_and_free_nodes() -> None:
    view = BUILDERS["cliques"](sample(), NOW, None)
    assert view.documents == [
        {
            "clique_id": CLIQUE,
            "nodes": 4,
            "healthy": 4,
            "bound": 3,
            "reserved": 1,
            "free": 0,
            "domains": ["team-a/train"],
        }
    ]


def test_json_documents_name_enums_and_keep_integers() -> None:
    doc = BUILDERS["members"](sample(lost_node=True), NOW, None).documents
    lost = next(d for d in doc if d["node_name"] == "rack0-tray1")
    assert lost["state"] == "LOST" and lost["index"] == -1
    assert lost["joined_unix_ms"] == NOW - 30_000
    json.dumps(doc)  # serializable as is


def test_table_columns_are_aligned() -> None:
    text = format_table(["A", "LONGER"], [["x", "1"], ["yyyy", "22"]])
    lines = text.splitlines()
    assert lines[0] == "A      LONGER"
    assert lines[2] == "yyyy   22"


def test_describe_explains_a_lost_node() -> None:
    snap = sample(lost_node=True)
    reasons = reasons_not_ready(snap, snap.domains[0])
    assert any(r.startswith("rack0-tray1: node lost") and "lease expired" in r for r in reasons)
    text = describe_domain(snap, snap.domains[0], NOW)
    assert "Status:        NotReady" in text
    assert "Ready=False  NodeLost" in text
    assert "Why not Ready:" in text


def test_describe_shows_a_failed_daemons_error_and_log_lines() -> None:
    snap = sample(failed_daemon=True)
    text = describe_domain(snap, snap.domains[0], NOW)
    assert "rack0-tray2: IMEX daemon FAILED after 4 restart(s): exited with code 1" in text
    assert "address already in use" in text


def test_describe_names_the_nodes_still_waited_for() -> None:
    snap = sample(num_nodes=5)
    snap.preparations = snap.preparations[:2]
    snap.members = snap.members[:2]
    reasons = reasons_not_ready(snap, snap.domains[0])
    assert any("2 of numNodes=5 active" in r and "rack0-tray2" in r for r in reasons)


def test_describe_of_a_ready_domain_says_so() -> None:
    snap = sample()
    text = describe_domain(snap, snap.domains[0], NOW)
    assert "Ready: every member's IMEX daemon is READY." in text
    assert "Why not Ready" not in text


def _cdctl(config: EtcdConfig, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cdctl.main",
            *args,
            "--etcd-endpoint",
            config.endpoint,
            "--etcd-prefix",
            config.prefix,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_cdctl_reads_the_store(store: Store, etcd_config: EtcdConfig) -> None:
    snap = sample(lost_node=True)
    k = store.keys
    for d in snap.domains:
        await store.put(k.domain(d.uid), d)
    for m in snap.members:
        await store.put(k.member(m.domain_uid, m.node_name), m)
    for n in snap.nodes:
        await store.put(k.node(n.name), n)
    for node, uid in snap.bindings.items():
        await store.put(k.node_binding(node), pb.NodeBinding(node_name=node, domain_uid=uid))
    for ds in snap.daemons:
        await store.put(k.daemon(ds.domain_uid, ds.node_name), ds)
    for r in snap.reservations:
        await store.put(k.reservation(r.id), r)

    result = _cdctl(etcd_config, "get", "domains", "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["kind"] == "domains"
    assert [(d["namespace"], d["name"], d["status"]["status"]) for d in doc["items"]] == [
        ("team-a", "train", "NOT_READY")
    ]

    result = _cdctl(etcd_config, "get", "nodes")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "ADDRESS", "CLIQUE"]
    assert len(lines) == 1 + 3  # the lost node has no record

    result = _cdctl(etcd_config, "get", "reservations")
    assert "r-1" in result.stdout

    result = _cdctl(etcd_config, "describe", "domain", "train", "-n", "team-a")
    assert result.returncode == 0, result.stderr
    assert "rack0-tray1: node lost" in result.stdout

    result = _cdctl(etcd_config, "describe", "domain", "train")
    assert result.returncode == 1
    assert "no ComputeDomain default/train (found in: team-a/train; use -n)" in result.stderr


def test_cdctl_reports_an_unreachable_store() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cdctl.main",
            "get",
            "domains",
            "--etcd-endpoint",
            "127.0.0.1:1",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot read the store at 127.0.0.1:1" in result.stderr
