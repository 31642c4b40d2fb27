"""The controller's in-memory view of the store, fed by watches.

One view per process, kept current in leader and standby alike (so a
standby takes over with a warm view). Each `apply_*` takes a watch event or a
Resync of one resource and returns the domain uids it affects, which the
reconciler queues. Records are compact (`observed.py`) so that 10,000 nodes
and 1,000 domains fit in a few tens of megabytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from libs.state.keys import Keys
from libs.state.watch import Resync, WatchEvent
from services.controller.mesh_view import MeshView
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.status_model import StatusValue


@dataclass(slots=True)
class DomainEntry:
    value: DomainRecord
    mod_revision: int
    # value.status decoded into plain values (again only when those bytes change).
    status: StatusValue


def _status_of(value: DomainRecord, current: DomainEntry | None) -> StatusValue:
    if current is not None and current.value.status == value.status:
        return current.status
    return StatusValue.from_pb(pb.ComputeDomainStatus().parse(value.status))


def _tail(key: str, prefix: str, parts: int) -> list[str] | None:
    """The `parts` '/'-separated segments of `key` after `prefix`, or None if it does not fit."""
    if not key.startswith(prefix):
        return None
    segments = key[len(prefix) :].split("/")
    if len(segments) != parts or not all(segments):
        return None
    return segments


class StoreView:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.domains: dict[str, DomainEntry] = {}
        self.members: dict[str, dict[str, MemberRecord]] = {}
        # node -> uids of domains it is a member of (lost memberships included).
        self.node_domains: dict[str, set[str]] = {}
        self.daemons: dict[str, dict[str, DaemonRecord]] = {}
        self.nodes: dict[str, NodeRecord] = {}
        # node -> claim uid -> domain uid, and the same by domain.
        self.preparations: dict[str, dict[str, str]] = {}
        self.domain_preparations: dict[str, dict[str, set[str]]] = {}
        self.mesh = MeshView(keys)

    # ---- reads ------------------------------------------------------------------

    def all_uids(self) -> set[str]:
        return set(self.domains) | set(self.members) | set(self.daemons) | self.mesh.uids()

    def observe(self, uid: str) -> DomainObservation:
        entry = self.domains.get(uid)
        members = dict(self.members.get(uid, {}))
        daemons = dict(self.daemons.get(uid, {}))
        nodes = {n: self.nodes[n] for n in members if n in self.nodes}
        preps = self.domain_preparations.get(uid, {})
        for node in preps:
            if node in self.nodes:
                nodes[node] = self.nodes[node]
        return DomainObservation(
            uid=uid,
            domain=entry.value if entry else None,
            domain_revision=entry.mod_revision if entry else 0,
            status=entry.status if entry else StatusValue(),
            members=members,
            daemons=daemons,
            nodes=nodes,
            preparations={n: frozenset(c) for n, c in preps.items() if c},
            mesh_authority=uid in self.mesh.authorities,
            mesh_requests=dict(self.mesh.requests.get(uid, {})),
            mesh_certificates=dict(self.mesh.certificates.get(uid, {})),
        )

    # ---- domains ------------------------------------------------------------------

    def _domain_uid(self, key: str) -> str | None:
        tail = _tail(key, self.keys.domains(), 1)
        return tail[0] if tail else None

    def put_domain(
        self, uid: str, value: DomainRecord, mod_revision: int, status: StatusValue | None = None
    ) -> None:
        current = self.domains.get(uid)
        # Our own writes are applied at once; the later echo of an older revision must not undo them.
        if current is None or mod_revision > current.mod_revision:
            plain = status if status is not None else _status_of(value, current)
            self.domains[uid] = DomainEntry(value, mod_revision, plain)

    def apply_domains(self, event: WatchEvent[DomainRecord] | Resync[DomainRecord]) -> set[str]:
        if isinstance(event, Resync):
            before = self.domains
            self.domains = {}
            for item in event.items:
                uid = self._domain_uid(item.key)
                if uid is not None:
                    self.domains[uid] = DomainEntry(
                        item.value, item.mod_revision, _status_of(item.value, before.get(uid))
                    )
            return set(before) | set(self.domains)
        uid = self._domain_uid(event.key)
        if uid is None:
            return set()
        if event.value is None:  # deleted, or undecodable: absent, as in a listing
            self.domains.pop(uid, None)
        else:
            self.put_domain(uid, event.value, event.revision)
        return {uid}

    # ---- members ------------------------------------------------------------------

    def _member_key(self, key: str) -> tuple[str, str] | None:
        tail = _tail(key, self.keys.all_members(), 2)
        return (tail[0], tail[1]) if tail else None

    def _set_member(self, uid: str, node: str, record: MemberRecord | None) -> None:
        if record is None:
            by_node = self.members.get(uid)
            if by_node is not None:
                by_node.pop(node, None)
                if not by_node:
                    del self.members[uid]
            uids = self.node_domains.get(node)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self.node_domains[node]
            return
        self.members.setdefault(uid, {})[node] = record
        self.node_domains.setdefault(node, set()).add(uid)

    def apply_members(self, event: WatchEvent[pb.Member] | Resync[pb.Member]) -> set[str]:
        if isinstance(event, Resync):
            before = set(self.members)
            self.members = {}
            self.node_domains = {}
            for item in event.items:
                parsed = self._member_key(item.key)
                if parsed is not None:
                    self._set_member(*parsed, MemberRecord.from_pb(item.value, item.mod_revision))
            return before | set(self.members)
        parsed = self._member_key(event.key)
        if parsed is None:
            return set()
        uid, node = parsed
        if event.value is None:  # deleted, or undecodable: absent, as in a listing
            self._set_member(uid, node, None)
        else:
            self._set_member(uid, node, MemberRecord.from_pb(event.value, event.revision))
        return {uid}

    # ---- daemons ------------------------------------------------------------------

    def _daemon_key(self, key: str) -> tuple[str, str] | None:
        tail = _tail(key, self.keys.all_daemons(), 2)
        return (tail[0], tail[1]) if tail else None

    def apply_daemons(self, event: WatchEvent[pb.DaemonStatus] | Resync[pb.DaemonStatus]) -> set[str]:
        if isinstance(event, Resync):
            before = set(self.daemons)
            self.daemons = {}
            for item in event.items:
                parsed = self._daemon_key(item.key)
                if parsed is not None:
                    self.daemons.setdefault(parsed[0], {})[parsed[1]] = DaemonRecord.from_pb(
                        item.value, item.mod_revision
                    )
            return before | set(self.daemons)
        parsed = self._daemon_key(event.key)
        if parsed is None:
            return set()
        uid, node = parsed
        if event.value is None:  # deleted, or undecodable: absent, as in a listing
            by_node = self.daemons.get(uid)
            if by_node is not None:
                by_node.pop(node, None)
                if not by_node:
                    del self.daemons[uid]
        else:
            self.daemons.setdefault(uid, {})[node] = DaemonRecord.from_pb(event.value, event.revision)
        return {uid}

    # ---- nodes --------------------------------------------------------------------

    def _node_name(self, key: str) -> str | None:
        tail = _tail(key, self.keys.nodes(), 1)
        return tail[0] if tail else None

    def _uids_of_node(self, node: str) -> set[str]:
        uids = set(self.node_domains.get(node, ()))
        uids.update(uid for uid in self.preparations.get(node, {}).values())
        return uids

    def apply_nodes(self, event: WatchEvent[pb.Node] | Resync[pb.Node]) -> set[str]:
        if isinstance(event, Resync):
            before = self.nodes
            self.nodes = {}
            for item in event.items:
                name = self._node_name(item.key)
                if name is not None:
                    self.nodes[name] = NodeRecord.from_pb(item.value)
            changed = {n for n in set(before) | set(self.nodes) if before.get(n) != self.nodes.get(n)}
            return self._affected_by_nodes(changed)
        name = self._node_name(event.key)
        if name is None:
            return set()
        if event.value is None:  # deleted, or undecodable: absent, as in a listing
            if self.nodes.pop(name, None) is None:
                return set()
        else:
            record = NodeRecord.from_pb(event.value)
            if self.nodes.get(name) == record:
                return set()
            self.nodes[name] = record
        return self._uids_of_node(name)

    def _affected_by_nodes(self, names: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for name in names:
            out |= self._uids_of_node(name)
        return out

    # ---- preparations ---------------------------------------------------------------

    def _preparation_key(self, key: str) -> tuple[str, str] | None:
        tail = _tail(key, self.keys.all_preparations(), 2)
        return (tail[0], tail[1]) if tail else None

    def _set_preparation(self, node: str, claim: str, uid: str | None) -> set[str]:
        affected: set[str] = set()
        old = self.preparations.get(node, {}).get(claim)
        if old is not None:
            affected.add(old)
            self.preparations[node].pop(claim, None)
            if not self.preparations[node]:
                del self.preparations[node]
            by_node = self.domain_preparations.get(old)
            if by_node is not None:
                claims = by_node.get(node)
                if claims is not None:
                    claims.discard(claim)
                    if not claims:
                        del by_node[node]
                if not by_node:
                    del self.domain_preparations[old]
        if uid:
            affected.add(uid)
            self.preparations.setdefault(node, {})[claim] = uid
            self.domain_preparations.setdefault(uid, {}).setdefault(node, set()).add(claim)
        return affected

    def apply_preparations(self, event: WatchEvent[pb.PreparedClaim] | Resync[pb.PreparedClaim]) -> set[str]:
        if isinstance(event, Resync):
            before = set(self.domain_preparations)
            self.preparations = {}
            self.domain_preparations = {}
            for item in event.items:
                parsed = self._preparation_key(item.key)
                if parsed is not None:
                    self._set_preparation(*parsed, item.value.domain_uid)
            return before | set(self.domain_preparations)
        parsed = self._preparation_key(event.key)
        if parsed is None:
            return set()
        if event.value is None:  # deleted, or undecodable: absent, as in a listing
            return self._set_preparation(*parsed, None)
        return self._set_preparation(*parsed, event.value.domain_uid)
