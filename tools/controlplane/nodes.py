"""Node objects standing in for kubelets on the loopback control plane.

No kubelet registers nodes here: a test creates the Node and writes the status a
kubelet would report (Ready, capacity), which is all kube-scheduler looks at.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio.client import CoreV1Api, V1Node, V1ObjectMeta

DEFAULT_ALLOCATABLE: Mapping[str, str] = {"cpu": "8", "memory": "32Gi", "pods": "110"}


def ready_node_status(allocatable: Mapping[str, str] = DEFAULT_ALLOCATABLE) -> dict[str, Any]:
    """The `status` of a healthy node with `allocatable` as both capacity and allocatable."""
    now = datetime.now(UTC).isoformat()
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "node registered by a test",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    return {"capacity": dict(allocatable), "allocatable": dict(allocatable), "conditions": [ready]}


async def create_schedulable_node(
    core: CoreV1Api,
    name: str,
    labels: Mapping[str, str] | None = None,
    allocatable: Mapping[str, str] = DEFAULT_ALLOCATABLE,
) -> V1Node:
    """Create Node `name` (labelled kubernetes.io/hostname=name plus `labels`) and mark it Ready."""
    all_labels = {"kubernetes.io/hostname": name, **(labels or {})}
    await core.create_node(V1Node(metadata=V1ObjectMeta(name=name, labels=all_labels)))
    # Status is a subresource: written separately, as a kubelet does.
    node: V1Node = await core.patch_node_status(name, {"status": ready_node_status(allocatable)})
    return node
