"""Compact records of what the controller observes in the store, per domain.

The controller keeps one in-memory view of the store (see `view.py`) for
thousands of nodes and domains; these slotted records hold only the fields the
decisions need, which keeps that view small. A `DomainObservation` is the
input of the pure core (`cd_status.py`, `membership_decisions.py`, `teardown.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from services.controller.mesh_view import MeshRequestRecord
from services.controller.status_model import StatusValue


@dataclass(frozen=True, slots=True)
class MemberRecord:
    node: str
    clique_id: str
    # -1 for a non-fabric node. Kept while the member is LOST (its slot is still its own).
    index: int
    lost: bool
    ip_address: str
    namespace: str
    joined_unix_ms: int
    mod_revision: int

    @property
    def fabric(self) -> bool:
        return bool(self.clique_id)

    @classmethod
    def from_pb(cls, member: pb.Member, mod_revision: int) -> MemberRecord:
        return cls(
            node=member.node_name,
            clique_id=member.clique_id,
            index=member.index,
            lost=member.state == pb.MemberState.LOST,
            ip_address=member.ip_address,
            namespace=member.namespace,
            joined_unix_ms=member.joined_unix_ms,
            mod_revision=mod_revision,
        )


@dataclass(frozen=True, slots=True)
class DaemonRecord:
    state: pb.DaemonState
    last_error: str
    updated_unix_ms: int
    # Member nodes the daemon reports CONNECTED (`nvidia-imex-ctl -N`): readiness of the mesh,
    # and the peers' word that a node whose record is gone is still there.
    connected_nodes: frozenset[str] = frozenset()
    # Of the daemons/<uid>/<node> key: a loss decision compares the reports it relied on.
    mod_revision: int = 0
    # Why it is not READY beyond its state (libs/contract/names.py REASON_*), "" if nothing more.
    reason: str = ""
    # Member nodes the daemon was connected to and lost (-N: DISCONNECTED): peers it cannot reach.
    disconnected_nodes: frozenset[str] = frozenset()

    @classmethod
    def from_pb(cls, daemon: pb.DaemonStatus, mod_revision: int = 0) -> DaemonRecord:
        return cls(
            pb.DaemonState(daemon.state),
            daemon.last_error,
            daemon.updated_unix_ms,
            frozenset(daemon.connected_nodes),
            mod_revision,
            daemon.reason,
            frozenset(daemon.disconnected_nodes),
        )


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node whose record is in the store, i.e. whose agent's lease is alive."""

    ip_address: str
    clique_id: str
    health: pb.Health

    @property
    def healthy(self) -> bool:
        return self.health != pb.Health.UNHEALTHY

    @classmethod
    def from_pb(cls, node: pb.Node) -> NodeRecord:
        return cls(node.ip_address, node.clique_id, pb.Health(node.health))


@dataclass(frozen=True)
class DomainObservation:
    """Everything the core needs to decide about one domain uid."""

    uid: str
    # None when the domain record is absent (not created yet, or torn down).
    domain: DomainRecord | None
    domain_revision: int = 0
    # The domain's stored status, as plain values.
    status: StatusValue = field(default_factory=StatusValue)
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    # Daemon statuses of this domain by node (members or not).
    daemons: Mapping[str, DaemonRecord] = field(default_factory=dict)
    # Node records present in the store, for (at least) every member node.
    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)
    # Prepared claims of this domain: node -> claim uids.
    preparations: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # IMEX mesh credentials: whether the CA exists, pending requests by node, and the request
    # digest each stored certificate answers.
    mesh_authority: bool = False
    mesh_requests: Mapping[str, MeshRequestRecord] = field(default_factory=dict)
    mesh_certificates: Mapping[str, str] = field(default_factory=dict)

    def node_present(self, node: str) -> bool:
        return node in self.nodes
