"""`cdsim status`: nodes, domains and jobs of the running cluster, as text or JSON."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tools.cdsim import workload
from tools.cdsim.job_book import JobList
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState
from tools.cdsim.services import agent_name, imex_agent_name
from tools.sim.hardware.cluster import ClusterDescription

READINESS = {pb.Readiness.READY: "Ready", pb.Readiness.NOT_READY: "NotReady"}
DAEMON_STATES = {
    pb.DaemonState.UNSPECIFIED: "-",
    pb.DaemonState.STARTING: "STARTING",
    pb.DaemonState.READY: "READY",
    pb.DaemonState.NOT_READY: "NOT_READY",
    pb.DaemonState.FAILED: "FAILED",
    pb.DaemonState.STOPPED: "STOPPED",
}


def readiness_name(value: pb.Readiness) -> str:
    return READINESS.get(value, str(int(value)))


def ready_condition(domain: pb.ComputeDomain) -> pb.Condition | None:
    return next((c for c in domain.status.conditions if c.type == "Ready"), None)


async def collect(layout: StateLayout, state: RunState, store: Store, jobs: JobList) -> dict[str, Any]:
    """The `status --json` document."""
    cluster = ClusterDescription.load(layout.cluster_file)
    keys = store.keys
    node_records = {n.value.name: n.value for n in (await store.list(keys.nodes(), pb.Node))[0]}
    bindings = {
        b.value.node_name: b.value.domain_uid
        for b in (await store.list(keys.node_bindings(), pb.NodeBinding))[0]
    }
    domains = [d.value for d in (await store.list(keys.domains(), pb.ComputeDomain))[0]]
    members = [m.value for m in (await store.list(keys.all_members(), pb.Member))[0]]
    daemons = {
        (d.value.domain_uid, d.value.node_name): d.value
        for d in (await store.list(keys.all_daemons(), pb.DaemonStatus))[0]
    }
    nodes = []
    for sim in cluster.nodes():
        dirs = layout.node(sim.name)
        record = node_records.get(sim.name)
        agent = state.processes.get(agent_name(sim.name))
        imex_agent = state.processes.get(imex_agent_name(sim.name))
        nodes.append(
            {
                "name": sim.name,
                "rack": sim.rack,
                "tray": sim.tray,
                "address": sim.address,
                "clique": record.clique_id if record else sim.clique,
                "kubelet_dir": str(dirs.kubelet_dir),
                "cdi_dir": str(dirs.cdi_root),
                "imex_dir": str(dirs.imex_dir),
                "registered": record is not None,
                "agent_running": bool(agent and agent.running),
                "agent_pid": agent.pid if agent else 0,
                "imex_agent_running": bool(imex_agent and imex_agent.running),
                "imex_agent_pid": imex_agent.pid if imex_agent else 0,
                "domain": bindings.get(sim.name, ""),
            }
        )
    domain_docs = []
    for domain in sorted(domains, key=lambda d: (d.created_unix_ms, d.namespace, d.name)):
        condition = ready_condition(domain)
        status_nodes = {n.name: n for n in domain.status.nodes}
        node_docs = []
        for m in sorted(
            (m for m in members if m.domain_uid == domain.uid),
            key=lambda m: (m.clique_id, m.index, m.node_name),
        ):
            shown = status_nodes.get(m.node_name)
            daemon = daemons.get((domain.uid, m.node_name))
            node_docs.append(
                {
                    "name": m.node_name,
                    "index": m.index,
                    "clique": m.clique_id,
                    "address": m.ip_address,
                    "member_state": "LOST" if m.state == pb.MemberState.LOST else "ACTIVE",
                    "status": readiness_name(shown.status) if shown else "NotReady",
                    "daemon": DAEMON_STATES.get(daemon.state, "-") if daemon else "-",
                    "daemon_pid": daemon.pid if daemon else 0,
                    "connected": sorted(daemon.connected_nodes) if daemon else [],
                }
            )
        domain_docs.append(
            {
                "uid": domain.uid,
                "namespace": domain.namespace,
                "name": domain.name,
                "status": readiness_name(domain.status.status),
                "reason": condition.reason if condition else "",
                "message": condition.message if condition else "",
                "deleting": domain.deleting,
                "num_nodes": domain.spec.num_nodes,
                "imex_mesh": domain.status.imex_mesh,
                "nodes": node_docs,
            }
        )
    reports = await asyncio.gather(*(workload.check(job.name, job.importers) for job in jobs.jobs))
    job_docs = [
        {
            "name": job.name,
            "namespace": job.namespace,
            "domain_uid": job.domain_uid,
            "state": job.state,
            "claims": [
                {"uid": c.uid, "name": c.name, "namespace": c.namespace, "node": c.node} for c in job.claims
            ],
            # None: the workload has not imported (submitted without --wait).
            "imports_intact": report.intact if job.importers else None,
            "imports_valid": report.valid,
            "imports_expected": report.expected,
            "import_problems": list(report.problems),
        }
        for job, report in zip(jobs.jobs, reports, strict=True)
    ]
    return {
        "state_dir": str(layout.root),
        "phase": state.phase,
        "etcd_endpoint": state.etcd_endpoint,
        "advisor_endpoint": state.advisor_endpoint,
        "tls_dir": state.tls_dir,
        "processes": [
            {
                "name": p.name,
                "kind": p.kind,
                "pid": p.pid,
                "running": p.running,
                "healthy": p.healthy,
                "restarts": p.restarts,
            }
            for p in state.processes.values()
        ],
        "nodes": nodes,
        "domains": domain_docs,
        "jobs": job_docs,
    }


def tray_cell(node: dict[str, Any], uid_letters: dict[str, str]) -> str:
    """One tray's character. A tray without a node record is not free: the advisor cannot place
    on it, so it is drawn apart from the free ones."""
    if not node["agent_running"]:
        return "!"
    if node["domain"]:
        return uid_letters.get(node["domain"], "?")
    return "." if node["registered"] else "-"


def render(doc: dict[str, Any]) -> str:
    lines = [f"cdsim cluster in {doc['state_dir']}: {doc['phase']}"]
    kinds = Counter(p["kind"] for p in doc["processes"])
    healthy = Counter(p["kind"] for p in doc["processes"] if p["healthy"])
    parts = [f"{kind} {healthy[kind]}/{count} healthy" for kind, count in sorted(kinds.items())]
    lines.append(f"  processes: {', '.join(parts)}")
    lines.append(f"  etcd {doc['etcd_endpoint']}, placement advisor {doc['advisor_endpoint']}")
    if doc.get("tls_dir"):
        lines.append(f"  secured: etcd TLS and auth, advisor mutual TLS; certificates in {doc['tls_dir']}")
    else:
        lines.append("  plaintext: etcd without TLS or auth, advisor without TLS (cdsim up --plaintext)")
    restarted = [p for p in doc["processes"] if p["restarts"]]
    if restarted:
        lines.append("  restarted: " + ", ".join(f"{p['name']} x{p['restarts']}" for p in restarted))
    by_rack: dict[int, list[dict[str, Any]]] = {}
    for node in doc["nodes"]:
        by_rack.setdefault(node["rack"], []).append(node)
    uid_letters = {d["uid"]: chr(ord("A") + i % 26) for i, d in enumerate(doc["domains"])}
    lines.append(
        "  racks (one character per tray: '.' free, letter = domain, '!' agent down, "
        "'-' not in the inventory):"
    )
    for rack, nodes in sorted(by_rack.items()):
        cells = "".join(tray_cell(n, uid_letters) for n in nodes)
        lines.append(f"    rack{rack:<3} {cells}")
    if not doc["domains"]:
        lines.append("  no ComputeDomains")
    for d in doc["domains"]:
        letter = uid_letters[d["uid"]]
        ready = sum(1 for n in d["nodes"] if n["status"] == "Ready")
        why = f" ({d['reason']}: {d['message']})" if d["status"] != "Ready" and d["reason"] else ""
        deleting = " [deleting]" if d["deleting"] else ""
        lines.append(
            f"  [{letter}] {d['namespace']}/{d['name']} {d['status']}{deleting}: "
            f"{ready}/{len(d['nodes'])} nodes ready{why}"
        )
    for job in doc["jobs"]:
        intact = job["imports_intact"]
        imports = (
            "no imports yet"
            if intact is None
            else f"imports {job['imports_valid']}/{job['imports_expected']} valid"
            + ("" if intact else " (BROKEN)")
        )
        lines.append(
            f"  job {job['namespace']}/{job['name']}: {job['state']}, {len(job['claims'])} claims, {imports}"
        )
    return "\n".join(lines)
