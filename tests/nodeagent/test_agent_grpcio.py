"""Kubelet's side of the sockets, played by grpcio (another gRPC and protobuf implementation).

Stubs are generated at test time with grpc_tools.protoc from the repo's protos/, so the wire
format is checked against Google's protobuf runtime, not against our own generated code.
"""

from __future__ import annotations

import importlib
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_tools import protoc

from libs.runtime.health import Health
from libs.state.store import Store
from services.nodeagent.wire.driver import ClaimDispatcher, DraServer, dra_socket_path
from services.nodeagent.wire.registration import (
    RegistrationServer,
    RegistrationService,
    registration_socket_path,
)
from tests.nodeagent.agent_fakes import fabric_node, make_device_state, new_uid, put_claim, put_domain

REPO = Path(__file__).resolve().parents[2]
PROTOS = {
    "drav1": REPO / "protos/k8s.io/kubelet/pkg/apis/dra/v1/api.proto",
    "drav1beta1": REPO / "protos/k8s.io/kubelet/pkg/apis/dra/v1beta1/api.proto",
    "pluginreg": REPO / "protos/pluginregistration/api.proto",
}


@dataclass
class Stubs:
    modules: dict[str, ModuleType]

    def pb(self, name: str) -> ModuleType:
        return self.modules[f"{name}_pb2"]

    def grpc(self, name: str) -> ModuleType:
        return self.modules[f"{name}_pb2_grpc"]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stubs]:
    out = tmp_path_factory.mktemp("grpcio-stubs")
    for name, source in PROTOS.items():
        # Flat file names: "k8s.io" is no valid Python package name.
        shutil.copy(source, out / f"{name}.proto")
        code = protoc.main(
            [
                "protoc",
                f"-I{out}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                str(out / f"{name}.proto"),
            ]
        )
        assert code == 0, f"protoc failed for {source}"
    sys.path.insert(0, str(out))
    try:
        modules = {
            f"{n}{s}": importlib.import_module(f"{n}{s}") for n in PROTOS for s in ("_pb2", "_pb2_grpc")
        }
        yield Stubs(modules)
    finally:
        sys.path.remove(str(out))
        for name in PROTOS:
            for suffix in ("_pb2", "_pb2_grpc"):
                sys.modules.pop(f"{name}{suffix}", None)


@dataclass
class Plugin:
    kubelet_dir: Path
    health: Health
    store: Store
    node: str
    domain_uid: str

    @property
    def dra_target(self) -> str:
        return f"unix://{dra_socket_path(self.kubelet_dir)}"

    @property
    def registration_target(self) -> str:
        return f"unix://{registration_socket_path(self.kubelet_dir)}"


@pytest.fixture
async def plugin(store: Store, tmp_path: Path) -> AsyncIterator[Plugin]:
    # Socket paths must fit in sun_path (108 bytes): pytest's tmp_path may be too deep.
    kubelet_dir = Path(tempfile.mkdtemp(prefix="na-")) / "kubelet"
    stale = dra_socket_path(kubelet_dir)
    stale.parent.mkdir(parents=True)
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))  # a socket file from a previous run, nobody listening
    leftover.close()
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node)
    domain = await put_domain(store)
    health = Health()
    dra = DraServer(ClaimDispatcher(n.state, n.state.metrics), dra_socket_path(kubelet_dir))
    registration = RegistrationServer(
        RegistrationService(dra.socket_path, health), registration_socket_path(kubelet_dir)
    )
    await dra.start()
    await registration.start()
    try:
        yield Plugin(kubelet_dir, health, store, node.name, domain.uid)
    finally:
        await registration.stop()
        await dra.stop()
        shutil.rmtree(kubelet_dir.parent, ignore_errors=True)


async def test_registration_get_info_and_status(plugin: Plugin, stubs: Stubs) -> None:
    reg_pb, reg_grpc = stubs.pb("pluginreg"), stubs.grpc("pluginreg")
    async with grpc.aio.insecure_channel(plugin.registration_target) as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
        assert info.type == "DRAPlugin"
        assert info.name == "compute-domain.nvidia.com"
        assert info.endpoint == str(plugin.kubelet_dir / "plugins/compute-domain.nvidia.com/dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]

        await stub.NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="unsupported versions"), timeout=5
        )
        assert not plugin.health.healthy
        assert "unsupported versions" in plugin.health.report()["problems"]["kubelet-registration"]  # type: ignore[index]
        await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert plugin.health.healthy


@pytest.mark.parametrize("version", ["drav1", "drav1beta1"])
async def test_prepare_and_unprepare_through_grpcio(plugin: Plugin, stubs: Stubs, version: str) -> None:
    pb, pb_grpc = stubs.pb(version), stubs.grpc(version)
    good = await put_claim(plugin.store, plugin.node, plugin.domain_uid)
    foreign = await put_claim(plugin.store, plugin.node, plugin.domain_uid, namespace="team-b")
    unknown_uid = new_uid()
    claims = [
        pb.Claim(namespace=good.namespace, name=good.name, uid=good.uid),
        pb.Claim(namespace=foreign.namespace, name=foreign.name, uid=foreign.uid),
    ]
    async with grpc.aio.insecure_channel(plugin.dra_target) as channel:
        stub = pb_grpc.DRAPluginStub(channel)
        reply = await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=claims), timeout=10)
        assert set(reply.claims) == {good.uid, foreign.uid}  # every claim answered
        ok = reply.claims[good.uid]
        assert ok.error == ""
        assert [
            (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in ok.devices
        ] == [
            (
                ["channel"],
                "rack0-tray0",
                "channel-0",
                [f"k8s.compute-domain.nvidia.com/claim={good.uid}-channel-0"],
            )
        ]
        refused = reply.claims[foreign.uid]
        assert "not in namespace team-b" in refused.error and list(refused.devices) == []

        again = await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=claims[:1]), timeout=10)
        assert again.claims[good.uid] == ok

        unprepare = pb.NodeUnprepareResourcesRequest(
            claims=[*claims, pb.Claim(namespace="team-a", name="never-seen", uid=unknown_uid)]
        )
        done = await stub.NodeUnprepareResources(unprepare, timeout=10)
        assert {uid: r.error for uid, r in done.claims.items()} == {
            good.uid: "",
            foreign.uid: "",
            unknown_uid: "",
        }

        stale = await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=claims[:1]), timeout=10)
        assert "refusing a stale prepare" in stale.claims[good.uid].error


async def test_sockets_are_not_world_writable(plugin: Plugin) -> None:
    for path in (dra_socket_path(plugin.kubelet_dir), registration_socket_path(plugin.kubelet_dir)):
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert mode & 0o007 == 0, f"{path} is accessible to others: {stat.filemode(mode)}"
