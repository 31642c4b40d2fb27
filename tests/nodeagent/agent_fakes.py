"""Store records and small fakes for node-agent tests (no processes)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.cdi.spec_dir import ClaimSpecDir
from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from services.nodeagent.core.checkpoint import Checkpoint, checkpoint_path
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.state import DeviceState
from services.nodeagent.wire.claim_source import StoreClaimSource

CLIQUE = "1c9e3f0a-6b7d-5e21-9a43-2f1b0c4d5e6f.7"
MAJOR = 234


def new_uid() -> str:
    return str(uuid.uuid4())


def channel_parameters(domain_uid: str, mode: str = "Single", **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": domain_uid,
        "allocationMode": mode,
    }
    params.update(extra)
    return params


async def put_domain(
    store: Store, namespace: str = "team-a", name: str = "cd1", uid: str | None = None
) -> pb.ComputeDomain:
    domain = pb.ComputeDomain(
        uid=uid or new_uid(),
        namespace=namespace,
        name=name,
        spec=pb.ComputeDomainSpec(channel=pb.ChannelSpec(resource_claim_template_name=f"{name}-channel")),
        source="simulation",
        # As the controller decides it (no controller runs here): plaintext keeps these tests on
        # the node agent; mutual TLS is exercised with a real controller in tests/cdsim.
        mesh_mode=pb.MeshMode.PLAINTEXT,
    )
    await store.put(store.keys.domain(domain.uid), domain)
    return domain


async def put_claim(
    store: Store,
    node: str,
    domain_uid: str,
    namespace: str = "team-a",
    *,
    mode: str = "Single",
    parameters: Any = None,
    name: str | None = None,
    uid: str | None = None,
) -> ClaimRef:
    """A claim record as cdsim writes it: request "channel" allocated channel-0 on `node`."""
    ref = ClaimRef(namespace=namespace, name=name or f"claim-{uuid.uuid4().hex[:6]}", uid=uid or new_uid())
    params = channel_parameters(domain_uid, mode) if parameters is None else parameters
    claim = pb.Claim(
        uid=ref.uid,
        namespace=ref.namespace,
        name=ref.name,
        node_name=node,
        results=[pb.AllocationResult(request="channel", driver=DRIVER_NAME, pool=node, device="channel-0")],
        config=[
            pb.OpaqueConfig(
                requests=["channel"],
                driver=DRIVER_NAME,
                parameters_json=params if isinstance(params, str) else json.dumps(params),
                source="FromClaim",
            )
        ],
    )
    await store.put(store.keys.claim(ref.uid), claim)
    return ref


@dataclass
class FakeIdentity:
    node: pb.Node


@dataclass
class FakeDaemons:
    """Stands in for the store view of the IMEX agent's daemons: ready unless told otherwise."""

    ready: bool = True
    waited: list[str] = field(default_factory=list)
    became_ready: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_ready(self, domain_uid: str, timeout_s: float, node_id: int | None = None) -> bool:
        self.waited.append(domain_uid)
        if self.ready:
            return True
        try:
            await asyncio.wait_for(self.became_ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class FakeChannelHardware:
    def __init__(self, dev_root: Path) -> None:
        self.dev_root = dev_root
        self.ensured: set[int] = set()

    def imex_channel_major(self) -> int:
        return MAJOR

    def ensure_imex_channel_device(self, channel: int) -> Path:
        self.ensured.add(channel)
        return self.dev_root / "nvidia-caps-imex-channels" / f"channel{channel}"


def fabric_node(name: str, address: str = "127.9.0.1", clique: str = CLIQUE) -> pb.Node:
    return pb.Node(name=name, ip_address=address, clique_id=clique)


def non_fabric_node(name: str, address: str = "127.9.0.2") -> pb.Node:
    return pb.Node(name=name, ip_address=address)


@dataclass
class NodeUnderTest:
    state: DeviceState
    daemons: FakeDaemons
    hardware: FakeChannelHardware
    kubelet_dir: Path
    cdi_root: Path
    boot_id_file: Path

    @property
    def node(self) -> pb.Node:
        return self.state.identity.node

    def reload_checkpoint(self) -> Checkpoint:
        return Checkpoint.load(checkpoint_path(self.kubelet_dir), self.boot_id_file, node=self.node.name)


def make_device_state(
    store: Store,
    base: Path,
    node: pb.Node,
    *,
    daemons: FakeDaemons | None = None,
    budget_s: float = 2.0,
    boot_id: str = "boot-1",
) -> NodeUnderTest:
    kubelet_dir = base / node.name / "kubelet"
    cdi_root = base / node.name / "cdi"
    boot_id_file = base / node.name / "boot_id"
    boot_id_file.parent.mkdir(parents=True, exist_ok=True)
    boot_id_file.write_text(boot_id + "\n")
    daemons = daemons or FakeDaemons()
    hardware = FakeChannelHardware(base / node.name / "dev")
    state = DeviceState(
        store=store,
        identity=FakeIdentity(node),
        claims=StoreClaimSource(store),
        daemons=daemons,
        hardware=hardware,
        checkpoint=Checkpoint.load(checkpoint_path(kubelet_dir), boot_id_file, node=node.name),
        cdi=ClaimSpecDir(cdi_root, host_dev_root=str(base / node.name / "dev")),
        metrics=AgentMetrics(),
        prepare_budget_s=budget_s,
    )
    return NodeUnderTest(state, daemons, hardware, kubelet_dir, cdi_root, boot_id_file)


async def store_dump(store: Store) -> dict[str, tuple[bytes, int]]:
    """Every key under the test's prefix with its value and mod revision."""
    result = await store.client.get_prefix(store.keys.prefix.encode())
    return {kv.key.decode(): (bytes(kv.value), int(kv.mod_revision)) for kv in result}


def file_tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its content (sockets and directories by name only)."""
    tree: dict[str, bytes] = {}
    if not root.exists():
        return tree
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_file():
            tree[rel] = path.read_bytes()
        else:
            tree[rel] = b"<dir>" if path.is_dir() else b"<special>"
    return tree
