"""The invariants of docs/state-model.md, checked against the real store and the nodes' local files.

Used by the tests, `cdsim check`, the demo and the chaos soak.

`check_store_invariants` covers invariants 1-4; for 4 it reads each member's IMEX files on disk
(with `nodes`): the fixed slot list, unchanged since its daemon started, and (at quiescence:
peers catch up shortly after a membership change) the slot resolution in its hosts file.
`check_inventory` covers invariant 7: a node whose agent is alive is in the inventory.
`check_domain_gone` covers invariant 5 after a domain was deleted: no record in the store, no
file, process or checkpoint entry on any node. `check_cluster_idle`
checks that nothing of any domain is left anywhere (the end of a demo).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.invariants import processes
from libs.state.membership import MAX_NODES_PER_IMEX_DOMAIN
from libs.state.store import Store

CDI_SPEC_PREFIX = "k8s.compute-domain.nvidia.com-claim_"
NODES_CONFIG_FILE = "nodes_config.cfg"
HOSTS_FILE = "hosts"
PID_FILE = "daemon.pid"
# /proc start times count in clock ticks (10 ms) and uptime is read a moment later.
_CLOCK_SLACK_S = 0.05


@dataclass(frozen=True)
class NodeLocalPaths:
    """Where one node keeps what the invariants inspect."""

    name: str
    cdi_root: Path
    imex_work_dir: Path
    checkpoint_file: Path


async def check_store_invariants(
    store: Store,
    max_per_clique: int = MAX_NODES_PER_IMEX_DOMAIN,
    quiescent: bool = True,
    nodes: Iterable[NodeLocalPaths] = (),
) -> list[str]:
    k = store.keys
    violations: list[str] = []
    domains = {d.value.uid: d.value for d in (await store.list(k.domains(), pb.ComputeDomain))[0]}
    members = [m.value for m in (await store.list(k.all_members(), pb.Member))[0]]
    bindings = {
        b.value.node_name: b.value.domain_uid
        for b in (await store.list(k.node_bindings(), pb.NodeBinding))[0]
    }
    preparations = [p.value for p in (await store.list(k.all_preparations(), pb.PreparedClaim))[0]]
    daemons = [d.value for d in (await store.list(k.all_daemons(), pb.DaemonStatus))[0]]

    # 1. A node is a member of at most one domain.
    domains_of_node: dict[str, set[str]] = defaultdict(set)
    for m in members:
        domains_of_node[m.node_name].add(m.domain_uid)
    for node, uids in domains_of_node.items():
        if len(uids) > 1:
            violations.append(f"inv1: node {node} is a member of {len(uids)} domains: {sorted(uids)}")
        bound = bindings.get(node)
        if bound is not None and uids and bound not in uids:
            violations.append(f"inv1: node {node} is bound to {bound} but a member of {sorted(uids)}")

    # 2. Index unique per clique, within [0, max), kept while the member exists (lost or not);
    #    -1 only for non-fabric members.
    seen: dict[tuple[str, str, int], str] = {}
    for m in members:
        if not m.clique_id:
            if m.index != -1:
                violations.append(
                    f"inv2: non-fabric member {m.node_name} of {m.domain_uid} has index {m.index}"
                )
            continue
        if not 0 <= m.index < max_per_clique:
            violations.append(
                f"inv2: member {m.node_name} of {m.domain_uid} has index {m.index} outside [0, {max_per_clique})"
            )
        slot = (m.domain_uid, m.clique_id, m.index)
        if slot in seen:
            violations.append(
                f"inv2: index {m.index} of clique {m.clique_id} in {m.domain_uid} held by {seen[slot]} and {m.node_name}"
            )
        seen[slot] = m.node_name

    # 3. Every prepared claim belongs to a domain listing its node, in the claim's namespace.
    member_set = {(m.domain_uid, m.node_name) for m in members}
    for p in preparations:
        if p.state != pb.PreparedState.PREPARE_COMPLETED:
            continue
        domain = domains.get(p.domain_uid)
        if domain is None:
            violations.append(
                f"inv3: claim {p.claim_uid} on {p.node_name} is prepared for missing domain {p.domain_uid}"
            )
            continue
        if domain.namespace != p.namespace:
            violations.append(
                f"inv3: claim {p.claim_uid} of namespace {p.namespace} is prepared for domain {domain.namespace}/{domain.name}"
            )
        if (p.domain_uid, p.node_name) not in member_set:
            violations.append(
                f"inv3: claim {p.claim_uid} is prepared on {p.node_name}, which is not a member of {p.domain_uid}"
            )

    # 4. Each member's daemon runs on its domain-and-clique's fixed slot list, never rewritten
    #    while it runs, and (once quiet) slot i resolves to the member holding index i.
    local = {n.name: n for n in nodes}
    for m in members:
        paths = local.get(m.node_name)
        if paths is None or not m.clique_id or m.index < 0:
            continue
        violations += check_daemon_files(
            paths, m, [x for x in members if x.domain_uid == m.domain_uid], quiescent
        )
    if quiescent:
        member_by_key = {(m.domain_uid, m.node_name): m for m in members}
        for d in daemons:
            me = member_by_key.get((d.domain_uid, d.node_name))
            if me is None or d.state != pb.DaemonState.READY or not d.peers:
                continue
            expected = slot_addresses([x for x in members if x.domain_uid == d.domain_uid], me.clique_id)
            if list(d.peers) != expected:
                violations.append(
                    f"inv4: daemon of {d.node_name} in {d.domain_uid} reports slot addresses "
                    f"{list(d.peers)}, members hold {expected}"
                )
    return violations


async def check_inventory(store: Store, live_nodes: Iterable[str]) -> list[str]:
    """Invariant 7: every node whose IMEX agent is alive has its record in the inventory.

    `live_nodes` are the nodes whose agent process runs (the caller knows: cdsim's supervisor, a
    test). A record that is missing or undecodable is what the placement advisor does not count,
    so the node silently drops out of placement while it looks free everywhere else. An agent
    writes its record again within a lease period; only at quiescence is its absence a fault.
    """
    items, _ = await store.list(store.keys.nodes(), pb.Node)
    present = {store.keys.last_segment(i.key) for i in items}
    return [
        f"inv7: node {node}'s IMEX agent is alive but its record {store.keys.node(node)} is "
        "missing or undecodable: the advisor does not count the node"
        for node in sorted(set(live_nodes) - present)
    ]


def slot_addresses(domain_members: Iterable[pb.Member], clique_id: str) -> list[str]:
    """What each slot of the clique should resolve to: its member's address (ACTIVE or LOST: a lost
    member keeps its index and address) or the placeholder.

    Should two records hold one index (an invariant 2 violation, reported as such), the lower node
    name wins, as in the IMEX agent (services/imexagent/slot_map.py), so the one fault is not
    reported again as every daemon's wrong slot resolution.
    """
    out = [slots.PLACEHOLDER_ADDRESS] * slots.MAX_SLOTS
    for m in sorted(domain_members, key=lambda m: m.node_name, reverse=True):
        if m.clique_id == clique_id and 0 <= m.index < slots.MAX_SLOTS:
            out[m.index] = m.ip_address
    return out


def check_daemon_files(
    paths: NodeLocalPaths, me: pb.Member, domain_members: list[pb.Member], quiescent: bool
) -> list[str]:
    """Invariant 4 on one member's node: its files as its daemon reads them."""
    directory = paths.imex_work_dir / me.domain_uid
    pid = _daemon_pid(directory)
    if pid is None:
        return []  # no daemon runs (starting, or restarting after a crash)
    where = f"{me.node_name} in {me.domain_uid}"
    violations = []
    nodes_config = directory / NODES_CONFIG_FILE
    try:
        text = nodes_config.read_text()
        written = nodes_config.stat().st_mtime
    except OSError:
        return [f"inv4: daemon pid {pid} of {where} runs without a readable nodes config"]
    if text != slots.render_nodes_config_slots(me.domain_uid, me.clique_id):
        violations.append(f"inv4: nodes config of {where} is not the clique's fixed slot list")
    started = _process_start_time(pid)
    if started is not None and written > started + _CLOCK_SLACK_S:
        violations.append(
            f"inv4: nodes config of {where} was rewritten {written - started:.2f}s after its daemon "
            f"(pid {pid}) started"
        )
    if quiescent:
        try:
            resolved = slots.parse_hosts((directory / HOSTS_FILE).read_text())
        except OSError:
            return [*violations, f"inv4: {where} has no readable hosts file for its slots"]
        names = slots.slot_names(me.domain_uid, me.clique_id)
        expected = slot_addresses(domain_members, me.clique_id)
        wrong = [
            f"slot {i} -> {resolved.get(name, 'unresolved')} (member address {expected[i]})"
            for i, name in enumerate(names)
            if resolved.get(name) != expected[i]
        ]
        if wrong:
            violations.append(f"inv4: slot resolution of {where} is wrong: {'; '.join(wrong)}")
    return violations


def _daemon_pid(directory: Path) -> int | None:
    """The live daemon the domain directory's pidfile names, None if none runs.

    The IMEX agent writes JSON ``{"pid": n, "start_ticks": t}`` (services/imexagent/process.py);
    a bare number is accepted too. A pid whose start time is not the recorded one was reused by
    another process, and a zombie has exited: neither is the daemon.
    """
    try:
        text = (directory / PID_FILE).read_text()
    except OSError:
        return None
    ticks: object = None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if isinstance(record, dict):
        pid, ticks = record.get("pid"), record.get("start_ticks")
    else:
        pid = record
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    started = _process_start_ticks(pid)
    if started is None or (ticks is not None and ticks != started):
        return None
    return pid


def _process_start_ticks(pid: int) -> int | None:
    """Start of a process in clock ticks since boot (field 22 of proc(5)); None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return None if fields[0] == "Z" else int(fields[19])  # fields[0] is field 3
    except (OSError, ValueError, IndexError):
        return None


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start of a process (from /proc), None if it is gone."""
    ticks = _process_start_ticks(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    if ticks is None:
        return None
    age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def imex_processes_of(domain_uid: str) -> list[int]:
    """PIDs whose command line mentions the domain uid (its per-domain config dir)."""
    return processes.processes_mentioning(domain_uid)


def _checkpoint_entries(path: Path) -> dict[str, dict[str, object]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return {k: v for k, v in (entries or {}).items() if isinstance(v, dict)}


def _entry_domain(entry: dict[str, object]) -> object:
    return entry.get("domainUID", entry.get("domain_uid"))


def _in_prefix(key: str, prefix: str) -> bool:
    """A listing of `prefix` that is one key (meshca/<uid>) also finds meshca/<uid><more>."""
    return prefix.endswith("/") or key == prefix


async def check_domain_gone(
    store: Store, domain_uid: str, claim_uids: Iterable[str] = (), nodes: Iterable[NodeLocalPaths] = ()
) -> list[str]:
    k = store.keys
    violations: list[str] = []
    if await store.get(k.domain(domain_uid), pb.ComputeDomain) is not None:
        violations.append(f"inv5: domain record {domain_uid} remains")
    for prefix, cls, what in (
        (k.members(domain_uid), pb.Member, "member"),
        (k.member_indices(domain_uid), pb.IndexClaim, "index claim"),
        (k.daemons(domain_uid), pb.DaemonStatus, "daemon status"),
        (k.mesh_authority(domain_uid), pb.MeshAuthority, "mesh CA"),
        (k.mesh_requests(domain_uid), pb.MeshCertificateRequest, "mesh certificate request"),
        (k.mesh_certificates(domain_uid), pb.MeshCertificate, "mesh certificate"),
    ):
        items, _ = await store.list(prefix, cls)
        violations += [f"inv5: {what} {i.key} remains" for i in items if _in_prefix(i.key, prefix)]
    bindings, _ = await store.list(k.node_bindings(), pb.NodeBinding)
    violations += [
        f"inv5: node binding {b.key} remains" for b in bindings if b.value.domain_uid == domain_uid
    ]
    preps, _ = await store.list(k.all_preparations(), pb.PreparedClaim)
    violations += [f"inv5: prepared claim {p.key} remains" for p in preps if p.value.domain_uid == domain_uid]
    claims = list(claim_uids)
    for uid in claims:
        if await store.get(k.claim(uid), pb.Claim) is not None:
            violations.append(f"inv5: claim record {uid} remains")
    for node in nodes:
        for uid in claims:
            for suffix in (".json", ".yaml"):
                spec = node.cdi_root / f"{CDI_SPEC_PREFIX}{uid}{suffix}"
                if spec.exists():
                    violations.append(f"inv5: CDI file {spec.name} remains on {node.name}")
        if (node.imex_work_dir / domain_uid).exists():
            violations.append(f"inv5: IMEX config dir for {domain_uid} remains on {node.name}")
        for uid, entry in _checkpoint_entries(node.checkpoint_file).items():
            if _entry_domain(entry) == domain_uid or uid in claims:
                violations.append(f"inv5: checkpoint entry {uid} for {domain_uid} remains on {node.name}")
    pids = imex_processes_of(domain_uid)
    if pids:
        violations.append(f"inv5: processes {pids} still run for {domain_uid}")
    return violations


async def check_cluster_idle(store: Store, nodes: Iterable[NodeLocalPaths]) -> list[str]:
    """Nothing of any domain is left: no records, CDI files, IMEX dirs or daemons, checkpoint entries."""
    k = store.keys
    violations: list[str] = []
    for prefix, cls, what in (
        (k.domains(), pb.ComputeDomain, "domain"),
        (k.all_members(), pb.Member, "member"),
        (k.all_member_indices(), pb.IndexClaim, "index claim"),
        (k.node_bindings(), pb.NodeBinding, "node binding"),
        (k.claims(), pb.Claim, "claim"),
        (k.all_preparations(), pb.PreparedClaim, "prepared claim"),
        (k.all_daemons(), pb.DaemonStatus, "daemon status"),
        (k.mesh_authorities(), pb.MeshAuthority, "mesh CA"),
        (k.all_mesh_requests(), pb.MeshCertificateRequest, "mesh certificate request"),
        (k.all_mesh_certificates(), pb.MeshCertificate, "mesh certificate"),
    ):
        items, _ = await store.list(prefix, cls)
        violations += [f"idle: {what} {i.key} remains" for i in items]
    for node in nodes:
        specs = (
            sorted(p.name for p in node.cdi_root.glob(f"{CDI_SPEC_PREFIX}*"))
            if node.cdi_root.exists()
            else []
        )
        violations += [f"idle: CDI file {name} remains on {node.name}" for name in specs]
        if node.imex_work_dir.exists():
            violations += [
                f"idle: IMEX dir {p.name} remains on {node.name}"
                for p in node.imex_work_dir.iterdir()
                if p.is_dir()
            ]
            daemons = processes.imex_daemons_under(node.imex_work_dir)
            violations += [f"idle: IMEX daemon pid {p.pid} still runs on {node.name}" for p in daemons]
        violations += [
            f"idle: checkpoint entry {uid} remains on {node.name}"
            for uid in _checkpoint_entries(node.checkpoint_file)
        ]
    return violations
