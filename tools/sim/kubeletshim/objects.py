"""The API objects a kubelet writes, as JSON-shaped dicts (pure).

Node and its status, the node Lease in ``kube-node-lease``, the status of a running pod, and the
Event kubelet records when it cannot prepare a pod's resource claims.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tools.sim.kubeletshim.nodes import ShimNode

NODE_LEASE_NAMESPACE = "kube-node-lease"
COMPONENT = "kubelet"
# Kubelet's reason for a failed NodePrepareResources (pkg/kubelet/events: FailedPrepareDynamicResources).
FAILED_PREPARE_REASON = "FailedPrepareDynamicResources"
# When the control plane's release is not known (see tools.sim.kubeletshim.release).
KUBELET_VERSION = "v1.37.2-kubeletshim"


def timestamp(now: datetime) -> str:
    """RFC 3339 with seconds, as metav1.Time serializes."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_timestamp(now: datetime) -> str:
    """RFC 3339 with microseconds, as metav1.MicroTime serializes."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_object(node: ShimNode) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": node.all_labels},
        "spec": {},
    }


def ready_condition(now: datetime, transition: datetime | None = None) -> dict[str, Any]:
    return {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "kubelet shim is posting ready status",
        "lastHeartbeatTime": timestamp(now),
        "lastTransitionTime": timestamp(transition or now),
    }


def node_status(
    node: ShimNode, now: datetime, ready_since: datetime | None = None, kubelet_version: str = KUBELET_VERSION
) -> dict[str, Any]:
    """Node.status of a healthy node: Ready, capacity = allocatable, addresses, node info."""
    addresses = [{"type": "Hostname", "address": node.name}]
    if node.address:
        addresses.insert(0, {"type": "InternalIP", "address": node.address})
    return {
        "capacity": dict(node.capacity),
        "allocatable": dict(node.capacity),
        "conditions": [ready_condition(now, ready_since)],
        "addresses": addresses,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": "",
            "osImage": "simulated",
            "containerRuntimeVersion": "none://0",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "arm64",
        },
    }


def node_lease(node_name: str, node_uid: str, now: datetime, duration_s: int) -> dict[str, Any]:
    """The coordination.k8s.io/v1 Lease kubelet renews (owned by its Node, like kubelet's)."""
    metadata: dict[str, Any] = {"name": node_name, "namespace": NODE_LEASE_NAMESPACE}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
        ]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": duration_s,
            "renewTime": micro_timestamp(now),
        },
    }


def running_pod_status(pod: Mapping[str, Any], host_ip: str, now: datetime) -> dict[str, Any]:
    """A status patch (strategic merge) that says: all containers started and ready."""
    when = timestamp(now)
    spec = pod.get("spec") or {}
    containers = [c for c in spec.get("containers") or [] if isinstance(c, Mapping)]
    uid = str((pod.get("metadata") or {}).get("uid", ""))
    conditions = [
        {"type": kind, "status": "True", "lastProbeTime": None, "lastTransitionTime": when}
        for kind in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
    ]
    status: dict[str, Any] = {
        "phase": "Running",
        "startTime": when,
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "imageID": "",
                "containerID": f"shim://{uid}/{c.get('name', '')}",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": when}},
            }
            for c in containers
        ],
    }
    if host_ip:
        status["hostIP"] = host_ip
        status["hostIPs"] = [{"ip": host_ip}]
        status["podIP"] = host_ip
        status["podIPs"] = [{"ip": host_ip}]
    return status


def event_name(pod_name: str, reason: str, message: str) -> str:
    """One Event object per (pod, reason, message): repeats bump its count, like kubelet's recorder."""
    digest = hashlib.sha256(f"{reason}\0{message}".encode()).hexdigest()[:16]
    return f"{pod_name}.{digest}"


def pod_event(
    pod: Mapping[str, Any], node_name: str, reason: str, message: str, now: datetime, warning: bool = True
) -> dict[str, Any]:
    """A core/v1 Event about `pod` from the kubelet of `node_name` (count 1)."""
    meta = pod.get("metadata") or {}
    when = timestamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(str(meta.get("name", "")), reason, message),
            "namespace": meta.get("namespace", "default"),
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": node_name},
        "reportingComponent": COMPONENT,
        "reportingInstance": node_name,
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }
