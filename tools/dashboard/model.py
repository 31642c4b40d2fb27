"""What the dashboard shows, computed from store records (pure: no I/O, no clock of its own).

`DashboardView` holds the latest domains, members, IMEX daemon statuses and node records, fed by
`resync` (a full listing) and `apply` (one watch event), and renders them as one JSON document:
racks of trays, each tray coloured by the domain it is in, with its daemon state and the reasons
a domain is not Ready. Where each tray is drawn comes from the simulated cluster description when
there is one (every tray, even one whose agent never came up), else from node records grouped by
NVLink clique (a rack of NVL72 is one clique).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import betterproto

from libs.gen.computedomain.state import v1 as pb
from libs.state.keys import Keys
from tools.sim.hardware.cluster import ClusterDescription

Resource = Literal["domains", "members", "daemons", "nodes"]
RESOURCES: tuple[Resource, ...] = ("domains", "members", "daemons", "nodes")
RESOURCE_TYPES: dict[Resource, type[betterproto.Message]] = {
    "domains": pb.ComputeDomain,
    "members": pb.Member,
    "daemons": pb.DaemonStatus,
    "nodes": pb.Node,
}

# Domain colours: well apart from each other, and none of them the red of a failure or the grey
# of a free tray. (background, text)
PALETTE: tuple[tuple[str, str], ...] = (
    ("#4e79a7", "#ffffff"),
    ("#f28e2b", "#111111"),
    ("#59a14f", "#ffffff"),
    ("#b07aa1", "#ffffff"),
    ("#edc948", "#111111"),
    ("#76b7b2", "#111111"),
    ("#ff9da7", "#111111"),
    ("#9c755f", "#ffffff"),
    ("#a0cbe8", "#111111"),
    ("#8cd17d", "#111111"),
)
RECENT_LIMIT = 40
DAEMON_LOG_LINES = 6
NO_FABRIC_RACK = "no NVLink fabric"

DAEMON_STATES = {
    pb.DaemonState.UNSPECIFIED: "",
    pb.DaemonState.STARTING: "STARTING",
    pb.DaemonState.READY: "READY",
    pb.DaemonState.NOT_READY: "NOT_READY",
    pb.DaemonState.FAILED: "FAILED",
    pb.DaemonState.STOPPED: "STOPPED",
}
HEALTH = {
    pb.Health.UNKNOWN: "UNKNOWN",
    pb.Health.HEALTHY: "HEALTHY",
    pb.Health.DEGRADED: "DEGRADED",
    pb.Health.UNHEALTHY: "UNHEALTHY",
}
# Reasons of a NotReady domain that mean something broke (the others are normal formation steps).
SEVERITY_OF_REASON = {
    "NodeLost": "warning",
    "PeerUnreachable": "warning",
    "ImexDaemonFailed": "error",
    "ImexDriverTooOld": "error",
    "ImexDaemonWaitingForRecovery": "warning",
}
_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[Any, ...]:
    """rack0-tray2 before rack0-tray10."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


@dataclass(frozen=True)
class Slot:
    """Where one node is drawn: its rack's label and its tray number in the rack."""

    node: str
    rack: str
    tray: int
    address: str = ""


def _readiness(value: pb.Readiness) -> str:
    return "Ready" if value == pb.Readiness.READY else "NotReady"


def _ready_condition(domain: pb.ComputeDomain) -> pb.Condition | None:
    return next((c for c in domain.status.conditions if c.type == "Ready"), None)


class DashboardView:
    """The dashboard's picture of the system; `version` grows with every change."""

    def __init__(
        self,
        keys: Keys,
        cluster: ClusterDescription | None = None,
        title: str = "ComputeDomains",
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.keys = keys
        self.title = title
        self.version = 0
        self._clock_ms = clock_ms or (lambda: 0)
        self.domains: dict[str, pb.ComputeDomain] = {}
        self.members: dict[tuple[str, str], pb.Member] = {}
        self.daemons: dict[tuple[str, str], pb.DaemonStatus] = {}
        self.nodes: dict[str, pb.Node] = {}
        self.synced: set[Resource] = set()
        self._colours: dict[str, int] = {}
        self._recent: list[dict[str, Any]] = []
        self._slots: dict[str, Slot] = {}
        self._fixed_layout = cluster is not None
        self.rack_order: list[str] = []
        if cluster is not None:
            for node in cluster.nodes():
                self._slots[node.name] = Slot(node.name, f"rack{node.rack}", node.tray, node.address)
            self.rack_order = [f"rack{r}" for r in range(cluster.racks)]

    # ---- feeding ---------------------------------------------------------------------------

    def _prefix(self, resource: Resource) -> str:
        return {
            "domains": self.keys.domains(),
            "members": self.keys.all_members(),
            "daemons": self.keys.all_daemons(),
            "nodes": self.keys.nodes(),
        }[resource]

    def _key_parts(self, resource: Resource, key: str) -> list[str] | None:
        prefix = self._prefix(resource)
        if not key.startswith(prefix):
            return None
        parts = key[len(prefix) :].split("/")
        want = 2 if resource in ("members", "daemons") else 1
        return parts if len(parts) == want and all(parts) else None

    def resync(self, resource: Resource, items: Iterable[tuple[str, betterproto.Message]]) -> None:
        """Replace everything known of `resource` with a full listing of (key, value)."""
        old = self._snapshot_of(resource)
        self._table(resource).clear()
        for key, value in items:
            self._put(resource, key, value, note=False)
        self._note_resync(resource, old)
        self.synced.add(resource)
        self._after_change()

    def apply(self, resource: Resource, key: str, value: betterproto.Message | None) -> None:
        """One watch event: a put (value) or a delete (None)."""
        if value is None:
            self._delete(resource, key)
        else:
            self._put(resource, key, value, note=True)
        self._after_change()

    def _table(self, resource: Resource) -> dict[Any, Any]:
        tables: dict[Resource, dict[Any, Any]] = {
            "domains": self.domains,
            "members": self.members,
            "daemons": self.daemons,
            "nodes": self.nodes,
        }
        return tables[resource]

    def _snapshot_of(self, resource: Resource) -> dict[Any, Any]:
        return dict(self._table(resource))

    def _put(self, resource: Resource, key: str, value: betterproto.Message, note: bool) -> None:
        parts = self._key_parts(resource, key)
        if parts is None:
            return
        table = self._table(resource)
        ident: Any = tuple(parts) if len(parts) == 2 else parts[0]
        previous = table.get(ident)
        table[ident] = value
        if isinstance(value, pb.ComputeDomain):
            self._colour_of(value.uid)
        if isinstance(value, pb.Node):
            self._learn_slot(value.name, value.clique_id, value.ip_address)
        if isinstance(value, pb.Member):
            self._learn_slot(value.node_name, value.clique_id, value.ip_address)
        if note:
            self._note_change(resource, ident, previous, value)

    def _delete(self, resource: Resource, key: str) -> None:
        parts = self._key_parts(resource, key)
        if parts is None:
            return
        ident: Any = tuple(parts) if len(parts) == 2 else parts[0]
        previous = self._table(resource).pop(ident, None)
        if previous is not None:
            self._note_change(resource, ident, previous, None)

    def _after_change(self) -> None:
        live = set(self.domains)
        for uid in [u for u in self._colours if u not in live]:
            del self._colours[uid]
        self.version += 1

    # ---- layout and colours ----------------------------------------------------------------

    def _learn_slot(self, node: str, clique: str, address: str) -> None:
        slot = self._slots.get(node)
        if slot is not None:
            if not slot.address and address:
                self._slots[node] = Slot(slot.node, slot.rack, slot.tray, address)
            return
        if self._fixed_layout:
            # A node outside the cluster description still shows, in a rack of its own.
            rack = "other nodes"
        else:
            rack = clique or NO_FABRIC_RACK
        trays = [s for s in self._slots.values() if s.rack == rack]
        self._slots[node] = Slot(node, rack, len(trays), address)
        if rack not in self.rack_order:
            self.rack_order.append(rack)
        if not self._fixed_layout:
            # Learned racks list their trays by node name, whatever order they were seen in.
            members = sorted([*trays, self._slots[node]], key=lambda s: natural_key(s.node))
            for position, s in enumerate(members):
                self._slots[s.node] = Slot(s.node, s.rack, position, s.address)
            self.rack_order.sort(key=lambda r: (r == NO_FABRIC_RACK, natural_key(r)))

    def _colour_of(self, uid: str) -> int:
        """A palette slot for a domain, kept for its whole life: the least used by live domains."""
        if uid not in self._colours:
            used = [0] * len(PALETTE)
            for other, slot in self._colours.items():
                if other in self.domains:
                    used[slot] += 1
            self._colours[uid] = min(range(len(PALETTE)), key=lambda i: (used[i], i))
        return self._colours[uid]

    # ---- what happened ---------------------------------------------------------------------

    def _remember(self, kind: str, text: str, severity: str = "info") -> None:
        self._recent.append(
            {"at_unix_ms": self._clock_ms(), "kind": kind, "text": text, "severity": severity}
        )
        del self._recent[:-RECENT_LIMIT]

    def _domain_label(self, uid: str) -> str:
        domain = self.domains.get(uid)
        return f"{domain.namespace}/{domain.name}" if domain else uid[:8]

    def _note_change(
        self,
        resource: Resource,
        ident: Any,
        before: betterproto.Message | None,
        after: betterproto.Message | None,
    ) -> None:
        if resource == "domains":
            self._note_domain(
                before if isinstance(before, pb.ComputeDomain) else None,
                after if isinstance(after, pb.ComputeDomain) else None,
            )
        elif resource == "nodes":
            if before is None and after is not None:
                self._remember("node", f"{ident}: node agent registered")
            elif before is not None and after is None:
                self._remember("node", f"{ident}: node record gone (agent down or lease expired)", "warning")
        elif resource == "members":
            uid, node = ident
            label = self._domain_label(uid)
            if before is None and isinstance(after, pb.Member):
                self._remember("member", f"{node} joined {label} (index {after.index})")
            elif after is None:
                self._remember("member", f"{node} left {label}")
            elif (
                isinstance(before, pb.Member) and isinstance(after, pb.Member) and before.state != after.state
            ):
                if after.state == pb.MemberState.LOST:
                    self._remember("member", f"{node} lost from {label}", "warning")
                else:
                    self._remember("member", f"{node} back in {label} (index {after.index})")
        elif resource == "daemons":
            uid, node = ident
            old = DAEMON_STATES.get(before.state, "") if isinstance(before, pb.DaemonStatus) else ""
            new = DAEMON_STATES.get(after.state, "") if isinstance(after, pb.DaemonStatus) else ""
            if new and new != old:
                error = after.last_error if isinstance(after, pb.DaemonStatus) else ""
                severity = "error" if new == "FAILED" else "info"
                suffix = f": {error}" if error and new != "READY" else ""
                self._remember(
                    "daemon", f"{node}: IMEX daemon {new} ({self._domain_label(uid)}){suffix}", severity
                )

    def _note_domain(self, before: pb.ComputeDomain | None, after: pb.ComputeDomain | None) -> None:
        if after is None:
            if before is not None:
                self._remember("domain", f"{before.namespace}/{before.name} deleted")
            return
        label = f"{after.namespace}/{after.name}"
        if before is None:
            self._remember("domain", f"{label} created")
            return
        if after.deleting and not before.deleting:
            self._remember("domain", f"{label} deleting")
        old_cond, new_cond = _ready_condition(before), _ready_condition(after)
        old = (before.status.status, old_cond.reason if old_cond else "")
        new = (after.status.status, new_cond.reason if new_cond else "")
        if old != new:
            status = _readiness(after.status.status)
            why = f" ({new_cond.reason}: {new_cond.message})" if new_cond and status != "Ready" else ""
            severity = SEVERITY_OF_REASON.get(new[1], "info") if status != "Ready" else "info"
            self._remember("domain", f"{label} {status}{why}", severity)

    def _note_resync(self, resource: Resource, old: dict[Any, Any]) -> None:
        # A relisting after a reconnect: report only what changed in between, as events would have.
        if resource not in self.synced:
            return
        table = self._table(resource)
        for ident in old.keys() | table.keys():
            before, after = old.get(ident), table.get(ident)
            if before != after:
                self._note_change(resource, ident, before, after)

    # ---- rendering -------------------------------------------------------------------------

    def _membership_by_node(self) -> dict[str, pb.Member]:
        chosen: dict[str, pb.Member] = {}
        for member in self.members.values():
            other = chosen.get(member.node_name)
            # One domain per node (invariant 1); an ACTIVE record wins over a LOST one in transition.
            rank = (member.state == pb.MemberState.ACTIVE, member.joined_unix_ms)
            if other is None or rank > (other.state == pb.MemberState.ACTIVE, other.joined_unix_ms):
                chosen[member.node_name] = member
        return chosen

    def _tray_doc(self, slot: Slot, member: pb.Member | None) -> dict[str, Any]:
        record = self.nodes.get(slot.node)
        uid = member.domain_uid if member else ""
        daemon = self.daemons.get((uid, slot.node)) if uid else None
        domain = self.domains.get(uid) if uid else None
        shown = next((n for n in domain.status.nodes if n.name == slot.node), None) if domain else None
        return {
            "node": slot.node,
            "tray": slot.tray,
            "address": (record.ip_address if record else "") or slot.address,
            "clique": record.clique_id if record else (member.clique_id if member else ""),
            "up": record is not None,
            "health": HEALTH.get(record.health, "UNKNOWN") if record else "",
            "fabric_message": record.fabric_message if record else "",
            "domain": uid,
            "index": member.index if member else None,
            "member": ("LOST" if member.state == pb.MemberState.LOST else "ACTIVE") if member else "",
            "status": _readiness(shown.status) if shown else "",
            "daemon": DAEMON_STATES.get(daemon.state, "") if daemon else "",
            "daemon_error": daemon.last_error if daemon else "",
            "daemon_log": list(daemon.last_log_lines[-DAEMON_LOG_LINES:]) if daemon else [],
            "restarts": daemon.restarts if daemon else 0,
        }

    def _domain_doc(self, domain: pb.ComputeDomain, members: list[pb.Member]) -> dict[str, Any]:
        condition = _ready_condition(domain)
        ready = {n.name for n in domain.status.nodes if n.status == pb.Readiness.READY}
        colour, ink = PALETTE[self._colour_of(domain.uid)]
        return {
            "uid": domain.uid,
            "namespace": domain.namespace,
            "name": domain.name,
            "status": _readiness(domain.status.status),
            "reason": condition.reason if condition else "",
            "message": condition.message if condition else "",
            "deleting": domain.deleting,
            "num_nodes": domain.spec.num_nodes,
            "members": len(members),
            "ready_members": sum(1 for m in members if m.node_name in ready),
            "lost_members": sorted(m.node_name for m in members if m.state == pb.MemberState.LOST),
            "colour": colour,
            "ink": ink,
            "created_unix_ms": domain.created_unix_ms,
        }

    def document(self) -> dict[str, Any]:
        """The whole picture as JSON-ready data (what the page renders)."""
        by_rack: dict[str, list[Slot]] = {}
        for slot in self._slots.values():
            by_rack.setdefault(slot.rack, []).append(slot)
        membership = self._membership_by_node()
        members_of: dict[str, list[pb.Member]] = {}
        for member in self.members.values():
            members_of.setdefault(member.domain_uid, []).append(member)
        racks = []
        for rack in self.rack_order:
            slots = sorted(by_rack.get(rack, []), key=lambda s: s.tray)
            trays = [self._tray_doc(s, membership.get(s.node)) for s in slots]
            cliques = sorted({t["clique"] for t in trays if t["clique"]})
            racks.append({"name": rack, "cliques": cliques, "trays": trays})
        domains = sorted(self.domains.values(), key=lambda d: (d.created_unix_ms, d.namespace, d.name))
        all_trays = [t for r in racks for t in r["trays"]]
        return {
            "title": self.title,
            "version": self.version,
            "synced": sorted(self.synced) == sorted(RESOURCES),
            "racks": racks,
            "domains": [self._domain_doc(d, members_of.get(d.uid, [])) for d in domains],
            "summary": {
                "nodes": len(all_trays),
                "nodes_up": sum(1 for t in all_trays if t["up"]),
                "nodes_in_domains": sum(1 for t in all_trays if t["domain"]),
                "domains": len(domains),
                "domains_ready": sum(1 for d in domains if d.status.status == pb.Readiness.READY),
            },
            "recent": list(reversed(self._recent)),
        }
