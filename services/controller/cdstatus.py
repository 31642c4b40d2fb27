"""The status of a ComputeDomain, computed from what the store shows (pure).

`desired_status` turns a `DomainObservation` into `status.status`,
`status.nodes` and `status.conditions` (SPEC §3, §5):

- a node is Ready when it is an active member whose node record is present
  and healthy and, for a fabric node, whose IMEX daemon reports READY;
- the domain is Ready when it is not being deleted, has at least one active
  member, every active member is Ready, no member is lost, and (numNodes > 0)
  at least numNodes members are active;
- the `Ready` condition carries the reason that explains a NotReady domain,
  most severe first: Terminating, NodeLost, ImexDaemonFailed,
  WaitingForNodes, ImexDaemonsNotReady.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.gen.computedomain.state import v1 as pb
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.statusmodel import ConditionEntry, NodeEntry, StatusValue

CONDITION_READY = "Ready"

REASON_ALL_NODES_READY = "AllNodesReady"
REASON_TERMINATING = "Terminating"
REASON_NODE_LOST = "NodeLost"
REASON_IMEX_DAEMON_FAILED = "ImexDaemonFailed"
REASON_WAITING_FOR_NODES = "WaitingForNodes"
REASON_DAEMONS_NOT_READY = "ImexDaemonsNotReady"

# A daemon in one of these states has failed (rather than still starting).
_FAILED_DAEMON_STATES = frozenset({pb.DaemonState.FAILED})

# How many node names a condition message lists before summarising.
_MAX_NAMED = 5


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the domain is Ready, and why (not)."""

    ready: bool
    reason: str
    message: str


def member_lost(member: MemberRecord, node: NodeRecord | None) -> bool:
    """Lost: marked so, or active while its node record is gone (lease expired)."""
    return member.lost or node is None


def daemon_failed(daemon: DaemonRecord | None) -> bool:
    if daemon is None:
        return False
    if daemon.state in _FAILED_DAEMON_STATES:
        return True
    # The supervisor reports NOT_READY with the exit reason while it restarts a crashed daemon.
    return daemon.state == pb.DaemonState.NOT_READY and bool(daemon.last_error)


def node_ready(member: MemberRecord, daemon: DaemonRecord | None, node: NodeRecord | None) -> bool:
    if member_lost(member, node) or node is None or not node.healthy:
        return False
    if not member.fabric:
        # A non-fabric node runs no IMEX daemon: present and healthy is all it can be.
        return True
    return daemon is not None and daemon.state == pb.DaemonState.READY


def node_statuses(obs: DomainObservation) -> tuple[NodeEntry, ...]:
    """status.nodes: every member (lost ones NotReady), sorted by name."""
    out: list[NodeEntry] = []
    for name in sorted(obs.members):
        member = obs.members[name]
        node = obs.nodes.get(name)
        lost = member_lost(member, node)
        out.append(
            NodeEntry(
                name=name,
                ip_address=member.ip_address or (node.ip_address if node else ""),
                clique_id=member.clique_id,
                index=member.index if member.fabric and not lost else -1,
                ready=node_ready(member, obs.daemons.get(name), node),
            )
        )
    return tuple(out)


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    extra = len(names) - _MAX_NAMED
    return f"{shown} and {extra} more" if extra > 0 else shown


def verdict(obs: DomainObservation) -> Verdict:
    domain = obs.domain
    num_nodes = domain.spec.num_nodes if domain is not None else 0
    active: list[MemberRecord] = []
    lost: list[str] = []
    for name in sorted(obs.members):
        member = obs.members[name]
        if member_lost(member, obs.nodes.get(name)):
            lost.append(name)
        else:
            active.append(member)
    if domain is not None and domain.deleting:
        remaining = len(obs.members)
        return Verdict(
            False,
            REASON_TERMINATING,
            f"deletion requested; waiting for {remaining} member(s) to leave"
            if remaining
            else "deletion requested; removing records",
        )
    if lost:
        return Verdict(
            False,
            REASON_NODE_LOST,
            f"node(s) lost (agent lease expired): {_names(lost)}; their indices were freed",
        )
    failed = [m.node for m in active if m.fabric and daemon_failed(obs.daemons.get(m.node))]
    if failed:
        details = []
        for name in failed[:_MAX_NAMED]:
            daemon = obs.daemons[name]
            details.append(f"{name}: {daemon.last_error or pb.DaemonState(daemon.state).name}")
        more = f"; and {len(failed) - _MAX_NAMED} more" if len(failed) > _MAX_NAMED else ""
        return Verdict(False, REASON_IMEX_DAEMON_FAILED, "IMEX daemon failed on " + "; ".join(details) + more)
    if not active:
        wanted = f"{num_nodes}" if num_nodes > 0 else "at least 1"
        return Verdict(False, REASON_WAITING_FOR_NODES, f"0 of {wanted} node(s) joined")
    if num_nodes > 0 and len(active) < num_nodes:
        return Verdict(False, REASON_WAITING_FOR_NODES, f"{len(active)} of {num_nodes} node(s) joined")
    not_ready = [m.node for m in active if not node_ready(m, obs.daemons.get(m.node), obs.nodes.get(m.node))]
    if not_ready:
        return Verdict(
            False,
            REASON_DAEMONS_NOT_READY,
            f"{len(active) - len(not_ready)} of {len(active)} node(s) ready; waiting for {_names(not_ready)}",
        )
    return Verdict(True, REASON_ALL_NODES_READY, f"{len(active)} of {len(active)} node(s) ready")


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


def desired_status(obs: DomainObservation, previous: StatusValue | None, now_ms: int) -> StatusValue:
    v = verdict(obs)
    ready_condition = ConditionEntry(CONDITION_READY, "True" if v.ready else "False", v.reason, v.message, 0)
    old_conditions = previous.conditions if previous is not None else ()
    return StatusValue(
        ready=v.ready,
        nodes=node_statuses(obs),
        conditions=merge_conditions(old_conditions, [ready_condition], now_ms),
    )
