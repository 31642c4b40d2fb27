"""Which nodes the shim plays: a nodes file, or a simulated cluster description (pure).

Nodes file (JSON)::

    {"nodes": [{"name": "rack0-tray0", "kubeletDir": "/path/kubelet", "address": "127.1.0.1",
                "labels": {"nvidia.com/gpu.clique": "<clusterUUID>.<cliqueId>"},
                "capacity": {"cpu": "72", "memory": "480Gi", "pods": "110"}}]}

``address`` and ``labels`` and ``capacity`` are optional. From a simulated cluster
(``tools.sim.hardware.cluster``) every node gets its loopback address, its clique label, and the
kubelet directory ``<nodes dir>/<node>/kubelet`` (the layout ``cdsim`` uses).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.sim.hardware.cluster import ClusterDescription

CLIQUE_LABEL = "nvidia.com/gpu.clique"
HOSTNAME_LABEL = "kubernetes.io/hostname"
DEFAULT_CAPACITY: Mapping[str, str] = {"cpu": "72", "memory": "480Gi", "pods": "110"}


@dataclass(frozen=True)
class ShimNode:
    name: str
    kubelet_dir: Path
    address: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))

    @property
    def all_labels(self) -> dict[str, str]:
        return {HOSTNAME_LABEL: self.name, **self.labels}


class NodesFileError(ValueError):
    """The nodes file is malformed; the message names the entry and field."""


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise NodesFileError(f"{where}: must be an object of strings")
    return dict(value)


def parse_nodes(doc: Any) -> list[ShimNode]:
    """Nodes from a decoded nodes file; NodesFileError naming the bad field otherwise."""
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise NodesFileError('the nodes file must be an object with a "nodes" list')
    nodes: list[ShimNode] = []
    seen: set[str] = set()
    for i, entry in enumerate(doc["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(entry, dict):
            raise NodesFileError(f"{where}: not an object")
        name, kubelet_dir = entry.get("name"), entry.get("kubeletDir")
        if not isinstance(name, str) or not name:
            raise NodesFileError(f"{where}.name: missing or not a string")
        if name in seen:
            raise NodesFileError(f"{where}.name: node {name!r} is listed twice")
        seen.add(name)
        if not isinstance(kubelet_dir, str) or not kubelet_dir:
            raise NodesFileError(f"{where}.kubeletDir: missing or not a string")
        address = entry.get("address", "")
        if not isinstance(address, str):
            raise NodesFileError(f"{where}.address: not a string")
        capacity = _string_map(entry.get("capacity"), f"{where}.capacity") or dict(DEFAULT_CAPACITY)
        nodes.append(
            ShimNode(
                name,
                Path(kubelet_dir),
                address,
                _string_map(entry.get("labels"), f"{where}.labels"),
                capacity,
            )
        )
    return nodes


def load_nodes_file(path: Path) -> list[ShimNode]:
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise NodesFileError(f"{path}: not JSON: {exc}") from None
    return parse_nodes(doc)


def nodes_document(nodes: list[ShimNode]) -> dict[str, Any]:
    """The nodes file content for `nodes` (inverse of parse_nodes)."""
    return {
        "nodes": [
            {
                "name": n.name,
                "kubeletDir": str(n.kubelet_dir),
                "address": n.address,
                "labels": dict(n.labels),
                "capacity": dict(n.capacity),
            }
            for n in nodes
        ]
    }


def nodes_of_cluster(cluster: ClusterDescription, nodes_dir: Path) -> list[ShimNode]:
    """Every node of a simulated cluster, with its clique label and cdsim's kubelet directory."""
    return [
        ShimNode(
            name=node.name,
            kubelet_dir=nodes_dir / node.name / "kubelet",
            address=node.address,
            labels={CLIQUE_LABEL: node.clique},
        )
        for node in cluster.nodes()
    ]
