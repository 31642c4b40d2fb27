"""One consistent-enough read of everything cdctl shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store


@dataclass
class Snapshot:
    domains: list[pb.ComputeDomain] = field(default_factory=list)
    members: list[pb.Member] = field(default_factory=list)
    nodes: list[pb.Node] = field(default_factory=list)
    bindings: dict[str, str] = field(default_factory=dict)
    daemons: list[pb.DaemonStatus] = field(default_factory=list)
    reservations: list[pb.Reservation] = field(default_factory=list)
    preparations: list[pb.PreparedClaim] = field(default_factory=list)
    claims: list[pb.Claim] = field(default_factory=list)
    revision: int = 0

    def domain_label(self, uid: str) -> str:
        domain = next((d for d in self.domains if d.uid == uid), None)
        return f"{domain.namespace}/{domain.name}" if domain else uid

    def node(self, name: str) -> pb.Node | None:
        return next((n for n in self.nodes if n.name == name), None)


async def load(store: Store) -> Snapshot:
    k = store.keys
    snap = Snapshot()
    snap.domains = [d.value for d in (await store.list(k.domains(), pb.ComputeDomain))[0]]
    snap.members = [m.value for m in (await store.list(k.all_members(), pb.Member))[0]]
    snap.nodes = [n.value for n in (await store.list(k.nodes(), pb.Node))[0]]
    bindings, _ = await store.list(k.node_bindings(), pb.NodeBinding)
    snap.bindings = {b.value.node_name: b.value.domain_uid for b in bindings}
    snap.daemons = [d.value for d in (await store.list(k.all_daemons(), pb.DaemonStatus))[0]]
    snap.reservations = [r.value for r in (await store.list(k.reservations(), pb.Reservation))[0]]
    snap.preparations = [p.value for p in (await store.list(k.all_preparations(), pb.PreparedClaim))[0]]
    claims, snap.revision = await store.list(k.claims(), pb.Claim)
    snap.claims = [c.value for c in claims]
    return snap
