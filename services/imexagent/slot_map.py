"""What this node's IMEX daemon should be, from the store's view of its domain (pure).

Every member of a domain-and-clique runs its daemon on the same ``MAX_SLOTS`` slot names
(``libs.imex.slots``); slot i resolves, through the domain directory's hosts file, to the address
of the member holding index i, or to the placeholder address while nobody holds it. A LOST member
keeps its index and address, so its slot keeps resolving to it: the daemons that still reach it
keep their link (a loss is often a lapsed lease of a node that is fine), and a dead peer left in
the map harms nobody.

This node's daemon is identified by (clique, index, address): those fix its node ID and the
address it binds, so they are the only things whose change restarts it. Peers coming, going or
changing address only change the slot addresses (a hosts rewrite and a SIGUSR1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots

_KEPT_STATES = (pb.MemberState.ACTIVE, pb.MemberState.LOST)


@dataclass(frozen=True)
class Identity:
    """What a daemon fixes at start: the nodes config (domain and clique), its own slot and address."""

    domain_uid: str
    clique_id: str
    index: int
    address: str


@dataclass(frozen=True)
class DesiredDaemon:
    """What should run for one domain on this node."""

    identity: Identity
    node_name: str
    # The address of each slot, in slot order (MAX_SLOTS entries).
    slot_addresses: tuple[str, ...]
    # The member node holding each slot ("" for an empty slot), to name connected peers.
    slot_nodes: tuple[str, ...]
    # This node's member is LOST: keep a running daemon, start none.
    lost: bool
    # Mod revision of this node's member record: status writes are fenced on it.
    member_revision: int
    # The domain's mesh mode as this node's join read it (UNDECIDED: read it from the domain).
    mesh_mode: pb.MeshMode = pb.MeshMode.UNDECIDED

    @property
    def domain_uid(self) -> str:
        return self.identity.domain_uid

    @property
    def clique_id(self) -> str:
        return self.identity.clique_id

    @property
    def index(self) -> int:
        return self.identity.index

    @property
    def address(self) -> str:
        return self.identity.address


@dataclass(frozen=True)
class Membership:
    """This node's standing in the domain it is bound to, as read from the store."""

    domain_uid: str | None
    # A member of domain_uid with no daemon to run (non-fabric node).
    non_fabric: bool = False
    desired: DesiredDaemon | None = None


def slot_holders(
    members: Sequence[pb.Member], clique_id: str, placeholder: str = slots.PLACEHOLDER_ADDRESS
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(address, node name) of every slot of the clique: its member's, or (placeholder, "").

    ACTIVE and LOST members hold their slots. Two records claiming one index cannot both be
    current (the index claim is unique); should a stale view show both, the lower node name wins
    so every node decides alike."""
    addresses = [placeholder] * slots.MAX_SLOTS
    names = [""] * slots.MAX_SLOTS
    for m in sorted(members, key=lambda m: m.node_name, reverse=True):
        if m.clique_id != clique_id or m.state not in _KEPT_STATES or not 0 <= m.index < slots.MAX_SLOTS:
            continue
        addresses[m.index] = m.ip_address or placeholder
        names[m.index] = m.node_name
    return tuple(addresses), tuple(names)


def membership_of(
    node_name: str,
    binding: pb.NodeBinding | None,
    members: Sequence[tuple[pb.Member, int]],
    placeholder: str = slots.PLACEHOLDER_ADDRESS,
) -> Membership:
    """Decide what this node runs, from its binding and its clique's members (with revisions)."""
    if binding is None or not binding.domain_uid:
        return Membership(None)
    uid = binding.domain_uid
    mine = next(((m, rev) for m, rev in members if m.node_name == node_name), None)
    if mine is None or mine[0].state not in _KEPT_STATES:
        return Membership(uid)
    member, revision = mine
    if not member.clique_id or member.index < 0:
        return Membership(uid, non_fabric=True)
    if member.index >= slots.MAX_SLOTS or not member.ip_address:
        return Membership(uid)  # a record no daemon can run on: nothing to start
    addresses, names = slot_holders([m for m, _ in members], member.clique_id, placeholder)
    identity = Identity(uid, member.clique_id, member.index, member.ip_address)
    return Membership(
        uid,
        desired=DesiredDaemon(
            identity=identity,
            node_name=node_name,
            slot_addresses=addresses,
            slot_nodes=names,
            lost=member.state == pb.MemberState.LOST,
            member_revision=revision,
            mesh_mode=pb.MeshMode(member.mesh_mode),
        ),
    )


def recently_connected(
    desired: DesiredDaemon, last_seen: dict[str, float], now: float, debounce_s: float
) -> list[str]:
    """Member nodes whose link was seen CONNECTED within `debounce_s`, in slot order.

    A link that drops for a moment (the daemon re-dials every link on SIGUSR1) is still reported
    connected; a peer that is really gone drops out after `debounce_s`.
    """
    return [
        name
        for index, name in enumerate(desired.slot_nodes)
        if name and index != desired.index and now - last_seen.get(name, -1e18) <= debounce_s
    ]


def disconnected_nodes(desired: DesiredDaemon, connections: dict[int, str]) -> list[str]:
    """Names of the other member nodes whose link the daemon reports DISCONNECTED (it was up in
    this instance's life and is lost), in slot order."""
    return [
        name
        for index, name in enumerate(desired.slot_nodes)
        if name and index != desired.index and connections.get(index) == "DISCONNECTED"
    ]


def connected_nodes(desired: DesiredDaemon, connections: dict[int, str]) -> list[str]:
    """Names of the other member nodes whose slot the daemon reports CONNECTED, in slot order."""
    return [
        name
        for index, name in enumerate(desired.slot_nodes)
        if name and index != desired.index and connections.get(index) == "CONNECTED"
    ]
