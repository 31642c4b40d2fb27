"""The status of a ComputeDomain, computed from what the store shows (pure).

`desired_status` turns a `DomainObservation` into `status.status`,
`status.nodes` and `status.conditions` (the shapes of NVIDIA's driver, docs/architecture.md):

- a member is lost when marked LOST, or when its node record is gone and no
  live peer's daemon reports it connected (`liveness.py`);
- a fabric member is ready when it is not lost, its node (if its record is
  there) is healthy, its IMEX daemon reports READY and that daemon reports
  every other active fabric member of its clique connected; a non-fabric
  member is ready when its node record is present and healthy;
- the domain is Ready when it is not being deleted, has at least one member,
  every member is ready, none is lost, and (numNodes > 0) at least numNodes
  members are present;
- the `Ready` condition carries the reason that explains a NotReady domain,
  most severe first: Terminating, NodeLost, ImexDriverTooOld, ImexDaemonFailed,
  ImexDaemonWaitingForRecovery, PeerUnreachable (node record alive, IMEX links lost:
  `reachability.py`), WaitingForNodes, ImexDaemonsNotReady, WaitingForPeers.
  The driver and recovery reasons are the IMEX agent's (the daemon status record's `reason`); a
  daemon waiting for recovery is also named in a NodeLost message, since a lost importer is
  often what it waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.contract.names import REASON_DRIVER_TOO_OLD, REASON_WAITING_FOR_RECOVERY
from libs.gen.computedomain.state import v1 as pb
from services.controller.liveness import Liveness, liveness
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord
from services.controller.reachability import Unreachable, unreachable
from services.controller.status_model import ConditionEntry, NodeEntry, StatusValue

CONDITION_READY = "Ready"

REASON_ALL_NODES_READY = "AllNodesReady"
REASON_TERMINATING = "Terminating"
REASON_NODE_LOST = "NodeLost"
REASON_IMEX_DAEMON_FAILED = "ImexDaemonFailed"
REASON_PEER_UNREACHABLE = "PeerUnreachable"
REASON_WAITING_FOR_NODES = "WaitingForNodes"
REASON_DAEMONS_NOT_READY = "ImexDaemonsNotReady"
REASON_WAITING_FOR_PEERS = "WaitingForPeers"
REASON_IMEX_DRIVER_TOO_OLD = REASON_DRIVER_TOO_OLD
REASON_IMEX_WAITING_FOR_RECOVERY = REASON_WAITING_FOR_RECOVERY

# A daemon in one of these states has failed (rather than still starting).
# status.imexMesh: how the domain's IMEX daemons authenticate each other.
MESH_LABELS = {pb.MeshMode.MUTUAL_TLS: "MutualTLS", pb.MeshMode.PLAINTEXT: "Plaintext"}

_FAILED_DAEMON_STATES = frozenset({pb.DaemonState.FAILED})

# How many node names a condition message lists before summarising.
_MAX_NAMED = 5


@dataclass(frozen=True, slots=True)
class ReadyCondition:
    """Whether the domain is Ready, and why (not)."""

    ready: bool
    reason: str
    message: str


def daemon_failed(daemon: DaemonRecord | None) -> bool:
    if daemon is None:
        return False
    if daemon.state in _FAILED_DAEMON_STATES:
        return True
    # The supervisor reports NOT_READY with the exit reason while it restarts a crashed daemon.
    return daemon.state == pb.DaemonState.NOT_READY and bool(daemon.last_error)


def daemon_up(obs: DomainObservation, member: MemberRecord, live: Liveness) -> bool:
    """Ready but for the mesh: not lost, node healthy, and (fabric) daemon READY."""
    if member.node in live.lost:
        return False
    node = obs.nodes.get(member.node)
    if not member.fabric:
        # A non-fabric node runs no IMEX daemon: present and healthy is all it can be.
        return node is not None and node.healthy
    if node is not None and not node.healthy:
        return False
    # No record but not lost: live peers report its daemon connected, so its (last) report stands.
    daemon = obs.daemons.get(member.node)
    return daemon is not None and daemon.state == pb.DaemonState.READY


def node_ready(obs: DomainObservation, member: MemberRecord, live: Liveness) -> bool:
    if not daemon_up(obs, member, live):
        return False
    return not member.fabric or not live.missing_peers(obs, member.node)


def node_statuses(obs: DomainObservation, live: Liveness | None = None) -> tuple[NodeEntry, ...]:
    """status.nodes: every member (lost ones NotReady, at the index they keep), sorted by name."""
    live = live if live is not None else liveness(obs)
    out: list[NodeEntry] = []
    for name in sorted(obs.members):
        member = obs.members[name]
        node = obs.nodes.get(name)
        out.append(
            NodeEntry(
                name=name,
                ip_address=member.ip_address or (node.ip_address if node else ""),
                clique_id=member.clique_id,
                index=member.index if member.fabric else -1,
                ready=node_ready(obs, member, live),
            )
        )
    return tuple(out)


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    extra = len(names) - _MAX_NAMED
    return f"{shown} and {extra} more" if extra > 0 else shown


def _lost_message(obs: DomainObservation, lost: Sequence[str]) -> str:
    shown = []
    for name in lost[:_MAX_NAMED]:
        member = obs.members[name]
        shown.append(f"{name} (index {member.index})" if member.fabric and member.index >= 0 else name)
    extra = len(lost) - _MAX_NAMED
    names = ", ".join(shown) + (f" and {extra} more" if extra > 0 else "")
    return (
        f"node(s) lost (node record gone, no peer connected): {names}; "
        "their indices are kept for their return until their claims are released"
    )


def _peers_message(obs: DomainObservation, waiting: Sequence[str], live: Liveness, total: int) -> str:
    details = [f"{name} to {_names(live.missing_peers(obs, name))}" for name in waiting[:_MAX_NAMED]]
    more = f"; and {len(waiting) - _MAX_NAMED} more" if len(waiting) > _MAX_NAMED else ""
    return (
        f"{total - len(waiting)} of {total} node(s) ready; IMEX daemon READY but not yet connected "
        "to peers: " + "; ".join(details) + more
    )


def _with_reason(obs: DomainObservation, members: Sequence[MemberRecord], reason: str) -> list[str]:
    """Fabric members whose daemon reports `reason`."""
    return [
        m.node
        for m in members
        if m.fabric and (d := obs.daemons.get(m.node)) is not None and d.reason == reason
    ]


def _reason_message(obs: DomainObservation, names: Sequence[str], what: str) -> str:
    details = [
        f"{name}: {obs.daemons[name].last_error or obs.daemons[name].reason}" for name in names[:_MAX_NAMED]
    ]
    more = f"; and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return f"{what} " + "; ".join(details) + more


def _unreachable_message(obs: DomainObservation, cut: Sequence[Unreachable]) -> str:
    cut_off = [u for u in cut if u.cut_off] or list(cut)
    shown = []
    for u in cut_off[:_MAX_NAMED]:
        member = obs.members[u.node]
        name = f"{u.node} (index {member.index})" if member.index >= 0 else u.node
        shown.append(f"{name} from {len(u.lost_by)} of {u.peers} peer(s)")
    extra = len(cut_off) - _MAX_NAMED
    return (
        "IMEX links lost while the node records are alive (not a node loss): "
        + "; ".join(shown)
        + (f"; and {extra} more" if extra > 0 else "")
        + ". Imports stay valid until the daemons' IMEX_NODE_DISCONNECTED_GRACE_TIME runs out"
    )


def ready_condition(obs: DomainObservation, live: Liveness | None = None) -> ReadyCondition:
    live = live if live is not None else liveness(obs)
    domain = obs.domain
    num_nodes = domain.spec.num_nodes if domain is not None else 0
    present = [obs.members[n] for n in sorted(obs.members) if n not in live.lost]
    lost = sorted(live.lost)
    if domain is not None and domain.deleting:
        remaining = len(obs.members)
        return ReadyCondition(
            False,
            REASON_TERMINATING,
            f"deletion requested; waiting for {remaining} member(s) to leave"
            if remaining
            else "deletion requested; removing records",
        )
    recovering = _with_reason(obs, present, REASON_WAITING_FOR_RECOVERY)
    if lost:
        message = _lost_message(obs, lost)
        if recovering:
            message += "; " + _reason_message(obs, recovering, "IMEX daemon waiting for recovery on")
        return ReadyCondition(False, REASON_NODE_LOST, message)
    too_old = _with_reason(obs, present, REASON_DRIVER_TOO_OLD)
    if too_old:
        return ReadyCondition(
            False, REASON_IMEX_DRIVER_TOO_OLD, _reason_message(obs, too_old, "IMEX daemon not started on")
        )
    failed = [m.node for m in present if m.fabric and daemon_failed(obs.daemons.get(m.node))]
    if failed:
        details = []
        for name in failed[:_MAX_NAMED]:
            daemon = obs.daemons[name]
            details.append(f"{name}: {daemon.last_error or pb.DaemonState(daemon.state).name}")
        more = f"; and {len(failed) - _MAX_NAMED} more" if len(failed) > _MAX_NAMED else ""
        return ReadyCondition(
            False, REASON_IMEX_DAEMON_FAILED, "IMEX daemon failed on " + "; ".join(details) + more
        )
    if recovering:
        return ReadyCondition(
            False,
            REASON_IMEX_WAITING_FOR_RECOVERY,
            _reason_message(obs, recovering, "IMEX daemon waiting for recovery on"),
        )
    cut = unreachable(obs, live)
    if cut:
        return ReadyCondition(False, REASON_PEER_UNREACHABLE, _unreachable_message(obs, cut))
    if not present:
        wanted = f"{num_nodes}" if num_nodes > 0 else "at least 1"
        return ReadyCondition(False, REASON_WAITING_FOR_NODES, f"0 of {wanted} node(s) joined")
    if num_nodes > 0 and len(present) < num_nodes:
        return ReadyCondition(
            False, REASON_WAITING_FOR_NODES, f"{len(present)} of {num_nodes} node(s) joined"
        )
    total = len(present)
    not_up = [m.node for m in present if not daemon_up(obs, m, live)]
    if not_up:
        # Counted without the mesh: peers of a daemon still starting cannot have reached it yet.
        return ReadyCondition(
            False,
            REASON_DAEMONS_NOT_READY,
            f"{total - len(not_up)} of {total} node(s) up; waiting for {_names(not_up)}",
        )
    waiting = [m.node for m in present if m.fabric and live.missing_peers(obs, m.node)]
    if waiting:
        return ReadyCondition(False, REASON_WAITING_FOR_PEERS, _peers_message(obs, waiting, live, total))
    return ReadyCondition(True, REASON_ALL_NODES_READY, f"{total} of {total} node(s) ready")


def merge_conditions(
    previous: Sequence[ConditionEntry], desired: Sequence[ConditionEntry], now_ms: int
) -> tuple[ConditionEntry, ...]:
    """Desired conditions, keeping each one's lastTransitionTime while its status is unchanged."""
    before = {c.type: c for c in previous}
    out: list[ConditionEntry] = []
    for cond in desired:
        old = before.get(cond.type)
        since = old.last_transition_unix_ms if old is not None and old.status == cond.status else now_ms
        out.append(ConditionEntry(cond.type, cond.status, cond.reason, cond.message, since))
    return tuple(out)


def desired_status(
    obs: DomainObservation, previous: StatusValue | None, now_ms: int, live: Liveness | None = None
) -> StatusValue:
    live = live if live is not None else liveness(obs)
    v = ready_condition(obs, live)
    ready_entry = ConditionEntry(CONDITION_READY, "True" if v.ready else "False", v.reason, v.message, 0)
    old_conditions = previous.conditions if previous is not None else ()
    return StatusValue(
        ready=v.ready,
        nodes=node_statuses(obs, live),
        conditions=merge_conditions(old_conditions, [ready_entry], now_ms),
        imex_mesh=MESH_LABELS.get(obs.domain.mesh_mode, "") if obs.domain is not None else "",
    )
