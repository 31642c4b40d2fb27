"""What Kubernetes says of the Nodes of a domain's members: the CD's `NodesReady` condition.

The domain's own readiness is the IMEX side's: node liveness is the IMEX agent's lease, kubelet's
never counts (docs/architecture.md), so a stopped kubelet leaves the node's IMEX daemon serving
the domain and `status.status` Ready. Kubernetes, though, acts on the Node's Ready condition: once
it is not True, the node lifecycle controller taints the Node and evicts its pods when their
tolerations run out, and the job then loses that pod. `NodesReady` tells the user beforehand:
False, reason NodeNotReady, naming every member node whose Node is not Ready and why (Kubernetes'
own reason, e.g. NodeStatusUnknown when kubelet stopped posting status); True once all are Ready.

The adapter lists the Nodes every NODE_HEALTH_INTERVAL_S (`NodeHealth.refresh`) and requeues the
domains of the nodes whose readiness changed. The condition itself is pure (`nodes_condition`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api

from services.controller.kube.computedomain import format_time
from services.controller.kube.events import EventSpec

CONDITION_NODES_READY = "NodesReady"
REASON_NODES_READY = "AllKubernetesNodesReady"
REASON_NODE_NOT_READY = "NodeNotReady"
NODE_HEALTH_INTERVAL_S = 5.0
_CALL_TIMEOUT_S = 30.0
# How many nodes a message names before summarising.
_MAX_NAMED = 5


@dataclass(frozen=True, slots=True)
class NodeReadiness:
    """A Node's Ready condition: status "False" or "Unknown" (a missing condition is Unknown)."""

    status: str
    reason: str
    message: str

    def describe(self, node: str) -> str:
        why = f"{self.reason}: {self.message}" if self.message else self.reason
        return f"{node} (Ready={self.status}{', ' + why if why else ''})"


def readiness_of(node: Mapping[str, Any]) -> NodeReadiness | None:
    """The Node's readiness when it is not Ready; None when its Ready condition is True."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None:
        return NodeReadiness("Unknown", "NoReadyCondition", "the Node has no Ready condition yet")
    if ready.get("status") == "True":
        return None
    return NodeReadiness(
        str(ready.get("status") or "Unknown"), ready.get("reason") or "", ready.get("message") or ""
    )


def not_ready_nodes(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeReadiness]:
    """Name -> readiness of every listed Node that is not Ready."""
    out = {}
    for node in nodes:
        found = readiness_of(node)
        if found is not None:
            out[str((node.get("metadata") or {}).get("name"))] = found
    return out


def nodes_condition(
    members: Iterable[str],
    not_ready: Mapping[str, NodeReadiness],
    previous: Mapping[str, Any] | None,
    now_unix_ms: int,
) -> dict[str, Any]:
    """The CR condition NodesReady for a domain with these member nodes. Its lastTransitionTime is
    `previous`'s (the CR's current NodesReady) while the status stays, else now."""
    down = sorted(n for n in set(members) if n in not_ready)
    if down:
        named = "; ".join(not_ready[n].describe(n) for n in down[:_MAX_NAMED])
        more = f"; and {len(down) - _MAX_NAMED} more" if len(down) > _MAX_NAMED else ""
        status, reason = "False", REASON_NODE_NOT_READY
        message = (
            f"Kubernetes reports {len(down)} member node(s) not Ready: {named}{more}. Their IMEX "
            "daemons keep serving the domain; their pods are evicted once they stop tolerating "
            "the node's not-ready or unreachable taint"
        )
    else:
        status, reason, message = "True", REASON_NODES_READY, "every member node is Ready in Kubernetes"
    if previous is not None and previous.get("status") == status and previous.get("lastTransitionTime"):
        since = str(previous["lastTransitionTime"])
    else:
        since = format_time(now_unix_ms)
    return {
        "type": CONDITION_NODES_READY,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }


def with_nodes_condition(
    desired: dict[str, Any],
    current: Mapping[str, Any] | None,
    members: Iterable[str],
    not_ready: Mapping[str, NodeReadiness],
    now_unix_ms: int,
) -> dict[str, Any]:
    """`desired` (a CR status) with NodesReady appended when the domain has members."""
    members = list(members)
    if not members:
        return desired
    previous = next(
        (c for c in (current or {}).get("conditions") or [] if c.get("type") == CONDITION_NODES_READY),
        None,
    )
    condition = nodes_condition(members, not_ready, previous, now_unix_ms)
    return desired | {"conditions": [*desired.get("conditions", []), condition]}


def _condition(status: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    conditions = (status or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == CONDITION_NODES_READY), None)


def node_events(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[EventSpec]:
    """A Warning NodeNotReady whenever the set of not-Ready member nodes (the message) changes
    while some are; a Normal NodesReady when all are Ready again."""
    old, new = _condition(before), _condition(after)
    if new is None:
        return []
    if new.get("status") == "True":
        if old is not None and old.get("status") != "True":
            return [EventSpec("Normal", "NodesReady", str(new.get("message", "")))]
        return []
    if old is None or old.get("message") != new.get("message"):
        return [EventSpec("Warning", REASON_NODE_NOT_READY, str(new.get("message", "")))]
    return []


class NodeHealth:
    """The not-Ready Nodes as last listed (empty until the first list)."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.core = CoreV1Api(api)
        self.not_ready: dict[str, NodeReadiness] = {}

    async def refresh(self) -> set[str]:
        """List the Nodes; return the names whose readiness changed since the last list."""
        listing = await self.core.list_node(_request_timeout=_CALL_TIMEOUT_S)
        items = self.api.sanitize_for_serialization(listing).get("items") or []
        found = not_ready_nodes(items)
        changed = {n for n in set(found) | set(self.not_ready) if found.get(n) != self.not_ready.get(n)}
        self.not_ready = found
        return changed
