"""The SPEC §4 invariants, checked against the real store (and node-local files).

Every scenario test ends with these. `check_store_invariants` covers
invariants 1-4 (4 only at quiescence, since peers' configs converge after a
membership change); `check_domain_gone` covers invariant 5 after a domain was
deleted: no record in the store and no file, process or checkpoint entry on
any node.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.state.membership import MAX_NODES_PER_IMEX_DOMAIN
from libs.state.store import Store


@dataclass(frozen=True)
class NodeLocalPaths:
    """Where one node keeps what invariant 5 inspects."""

    name: str
    cdi_root: Path
    imex_work_dir: Path
    checkpoint_file: Path


async def check_store_invariants(
    store: Store, max_per_clique: int = MAX_NODES_PER_IMEX_DOMAIN, quiescent: bool = True
) -> list[str]:
    k = store.keys
    violations: list[str] = []
    domains = {d.value.uid: d.value for d in (await store.list(k.domains(), pb.ComputeDomain))[0]}
    members = [m.value for m in (await store.list(k.all_members(), pb.Member))[0]]
    bindings = {b.value.node_name: b.value.domain_uid for b in (await store.list(k.node_bindings(), pb.NodeBinding))[0]}
    preparations = [p.value for p in (await store.list(k.all_preparations(), pb.PreparedClaim))[0]]
    daemons = [d.value for d in (await store.list(k.all_daemons(), pb.DaemonStatus))[0]]
    nodes = {n.value.name: n.value for n in (await store.list(k.nodes(), pb.Node))[0]}

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

    # 2. Index unique per clique, within [0, max); -1 only for non-fabric or lost members.
    seen: dict[tuple[str, str, int], str] = {}
    for m in members:
        if m.state != pb.MemberState.ACTIVE:
            continue
        if not m.clique_id:
            if m.index != -1:
                violations.append(f"inv2: non-fabric member {m.node_name} of {m.domain_uid} has index {m.index}")
            continue
        if not 0 <= m.index < max_per_clique:
            violations.append(f"inv2: member {m.node_name} of {m.domain_uid} has index {m.index} outside [0, {max_per_clique})")
        slot = (m.domain_uid, m.clique_id, m.index)
        if slot in seen:
            violations.append(f"inv2: index {m.index} of clique {m.clique_id} in {m.domain_uid} held by {seen[slot]} and {m.node_name}")
        seen[slot] = m.node_name

    # 3. Every prepared claim belongs to a domain listing its node, in the claim's namespace.
    member_set = {(m.domain_uid, m.node_name) for m in members}
    for p in preparations:
        if p.state != pb.PreparedState.PREPARE_COMPLETED:
            continue
        domain = domains.get(p.domain_uid)
        if domain is None:
            violations.append(f"inv3: claim {p.claim_uid} on {p.node_name} is prepared for missing domain {p.domain_uid}")
            continue
        if domain.namespace != p.namespace:
            violations.append(
                f"inv3: claim {p.claim_uid} of namespace {p.namespace} is prepared for domain {domain.namespace}/{domain.name}"
            )
        if (p.domain_uid, p.node_name) not in member_set:
            violations.append(f"inv3: claim {p.claim_uid} is prepared on {p.node_name}, which is not a member of {p.domain_uid}")

    # 4. Each member's daemon was given exactly the current members of its clique in that domain.
    if quiescent:
        by_clique: dict[tuple[str, str], list[pb.Member]] = defaultdict(list)
        for m in members:
            if m.state == pb.MemberState.ACTIVE and m.clique_id:
                by_clique[(m.domain_uid, m.clique_id)].append(m)
        member_by_key = {(m.domain_uid, m.node_name): m for m in members}
        for d in daemons:
            me = member_by_key.get((d.domain_uid, d.node_name))
            if me is None or me.state != pb.MemberState.ACTIVE or d.state != pb.DaemonState.READY:
                continue
            # Slot i resolves to the member holding index i, an empty slot to the placeholder.
            expected = [slots.PLACEHOLDER_ADDRESS] * slots.MAX_SLOTS
            for x in by_clique[(d.domain_uid, me.clique_id)]:
                if 0 <= x.index < slots.MAX_SLOTS:
                    expected[x.index] = x.ip_address
            if list(d.peers) != expected:
                violations.append(f"inv4: daemon of {d.node_name} in {d.domain_uid} has peers {list(d.peers)}, members are {expected}")
    _ = nodes
    return violations


def imex_processes_of(domain_uid: str) -> list[int]:
    """PIDs whose command line mentions the domain uid (its per-domain config dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if domain_uid.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


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
    violations += [f"inv5: node binding {b.key} remains" for b in bindings if b.value.domain_uid == domain_uid]
    preps, _ = await store.list(k.all_preparations(), pb.PreparedClaim)
    violations += [f"inv5: prepared claim {p.key} remains" for p in preps if p.value.domain_uid == domain_uid]
    claims = list(claim_uids)
    for node in nodes:
        for uid in claims:
            for suffix in (".json", ".yaml"):
                spec = node.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{uid}{suffix}"
                if spec.exists():
                    violations.append(f"inv5: CDI file {spec.name} remains on {node.name}")
        if (node.imex_work_dir / domain_uid).exists():
            violations.append(f"inv5: IMEX config dir for {domain_uid} remains on {node.name}")
        if node.checkpoint_file.exists():
            try:
                doc = json.loads(node.checkpoint_file.read_text())
            except ValueError:
                doc = {}
            for uid, entry in (doc.get("entries") or {}).items():
                if isinstance(entry, dict) and entry.get("domainUID", entry.get("domain_uid")) == domain_uid:
                    violations.append(f"inv5: checkpoint entry {uid} for {domain_uid} remains on {node.name}")
    pids = imex_processes_of(domain_uid)
    if pids:
        violations.append(f"inv5: processes {pids} still run for {domain_uid}")
    return violations
