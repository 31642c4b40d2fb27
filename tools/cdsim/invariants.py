"""The SPEC §4 invariants, checked against the real store and the nodes' local files.

Used by `cdsim check`, the demo and the tests (imports nothing from tests/).

`check_store_invariants` covers invariants 1-4 (4 only at quiescence: peers' nodes configs
converge shortly after a membership change); with `nodes` it also reads each READY member's
nodes config file on disk. `check_domain_gone` covers invariant 5 after a domain was deleted: no
record in the store, no file, process or checkpoint entry on any node. `check_cluster_idle`
checks that nothing of any domain is left anywhere (the end of a demo).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex.config import parse_nodes_config
from libs.state.membership import MAX_NODES_PER_IMEX_DOMAIN
from libs.state.store import Store
from tools.cdsim import procscan
from tools.cdsim.layout import StateLayout

CDI_SPEC_PREFIX = "k8s.compute-domain.nvidia.com-claim_"
NODES_CONFIG_FILE = "nodes_config.cfg"


@dataclass(frozen=True)
class NodeLocalPaths:
    """Where one node keeps what the invariants inspect."""

    name: str
    cdi_root: Path
    imex_work_dir: Path
    checkpoint_file: Path


def _read_nodes_config(path: Path) -> list[str] | None:
    try:
        return parse_nodes_config(path.read_text())
    except (OSError, ValueError):
        return None


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

    # 2. Index unique per clique, within [0, max); -1 only for non-fabric (or lost) members.
    seen: dict[tuple[str, str, int], str] = {}
    for m in members:
        if m.state != pb.MemberState.ACTIVE:
            continue
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

    # 4. Each member's daemon was given exactly the current members of its clique in that domain.
    if quiescent:
        by_clique: dict[tuple[str, str], list[pb.Member]] = defaultdict(list)
        for m in members:
            if m.state == pb.MemberState.ACTIVE and m.clique_id:
                by_clique[(m.domain_uid, m.clique_id)].append(m)
        member_by_key = {(m.domain_uid, m.node_name): m for m in members}
        local = {n.name: n for n in nodes}
        for d in daemons:
            me = member_by_key.get((d.domain_uid, d.node_name))
            if me is None or me.state != pb.MemberState.ACTIVE or d.state != pb.DaemonState.READY:
                continue
            expected = [
                x.ip_address for x in sorted(by_clique[(d.domain_uid, me.clique_id)], key=lambda x: x.index)
            ]
            if list(d.peers) != expected:
                violations.append(
                    f"inv4: daemon of {d.node_name} in {d.domain_uid} has peers {list(d.peers)}, members are {expected}"
                )
            paths = local.get(d.node_name)
            if paths is not None:
                on_disk = _read_nodes_config(paths.imex_work_dir / d.domain_uid / NODES_CONFIG_FILE)
                if on_disk is None:
                    violations.append(f"inv4: {d.node_name} has no readable nodes config for {d.domain_uid}")
                elif sorted(on_disk) != sorted(expected):
                    violations.append(
                        f"inv4: nodes config of {d.node_name} in {d.domain_uid} lists {on_disk}, members are {expected}"
                    )
    return violations


def imex_processes_of(domain_uid: str) -> list[int]:
    """PIDs whose command line mentions the domain uid (its per-domain config dir)."""
    return [p.pid for p in procscan.list_processes() if any(domain_uid in arg for arg in p.argv)]


def _checkpoint_entries(path: Path) -> dict[str, dict[str, object]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return {k: v for k, v in (entries or {}).items() if isinstance(v, dict)}


def _entry_domain(entry: dict[str, object]) -> object:
    return entry.get("domainUID", entry.get("domain_uid"))


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
    ):
        items, _ = await store.list(prefix, cls)
        violations += [f"inv5: {what} {i.key} remains" for i in items]
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
            daemons = procscan.imex_daemons_under(node.imex_work_dir)
            violations += [f"idle: IMEX daemon pid {p.pid} still runs on {node.name}" for p in daemons]
        violations += [
            f"idle: checkpoint entry {uid} remains on {node.name}"
            for uid in _checkpoint_entries(node.checkpoint_file)
        ]
    return violations


def cluster_node_paths(layout: StateLayout, node_names: Iterable[str]) -> list[NodeLocalPaths]:
    """The node-local paths of a cdsim cluster's nodes."""
    out = []
    for name in node_names:
        dirs = layout.node(name)
        out.append(NodeLocalPaths(name, dirs.cdi_root, dirs.imex_dir, dirs.checkpoint_file))
    return out
