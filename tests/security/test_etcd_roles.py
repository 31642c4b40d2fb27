"""The components' etcd roles (libs/state/roles.py) on a real etcd with auth: the controller alone
reads a domain's mesh CA; the IMEX agent does its mesh work without it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aetcd import rpc

from libs.gen.computedomain.state import v1 as pb
from libs.state import roles
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.etcd.server import EtcdServer

PREFIX = "/cd/v1/"


@pytest.fixture
async def secured(etcd_bin: Path, tmp_path: Path) -> AsyncIterator[dict[str, EtcdConfig]]:
    server = EtcdServer(data_dir=tmp_path / "etcd", binary=etcd_bin)
    server.start()
    configs: dict[str, EtcdConfig] = {}
    try:
        async with Store(EtcdConfig(endpoint=server.endpoint, prefix=PREFIX)) as store:
            auth = rpc.AuthStub(store.client.channel)
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
            await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=secrets.token_hex(8)), timeout=5)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            await roles.grant_roles(auth, PREFIX)
            for component in roles.COMPONENTS:
                password = secrets.token_hex(8)
                await auth.UserAdd(rpc.AuthUserAddRequest(name=component, password=password), timeout=5)
                await auth.UserGrantRole(
                    rpc.AuthUserGrantRoleRequest(user=component, role=component), timeout=5
                )
                configs[component] = EtcdConfig(
                    endpoint=server.endpoint, prefix=PREFIX, username=component, password=password
                )
            await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
        yield configs
    finally:
        server.destroy()


async def test_only_the_controller_reads_a_mesh_ca(secured: dict[str, EtcdConfig]) -> None:
    ca = pb.MeshAuthority(domain_uid="u1", ca_cert_pem=b"cert", ca_key_pem=b"key")
    async with Store(secured[roles.CONTROLLER]) as controller:
        await controller.put(controller.keys.mesh_authority("u1"), ca)
        got = await controller.get(controller.keys.mesh_authority("u1"), pb.MeshAuthority)
        assert got is not None and got.value.ca_key_pem == b"key"
        await controller.put(controller.keys.domain("u1"), pb.ComputeDomain(uid="u1"))
    for component in (roles.IMEX_AGENT, roles.NODE_AGENT, roles.ADVISOR):
        async with Store(secured[component]) as store:
            with pytest.raises(Exception, match=r"(?i)permission denied"):
                await store.get(store.keys.mesh_authority("u1"), pb.MeshAuthority)
            with pytest.raises(Exception, match=r"(?i)permission denied"):
                await store.list(store.keys.mesh_authorities(), pb.MeshAuthority)
            # Everything else of the prefix stays theirs.
            domains, _ = await store.list(store.keys.domains(), pb.ComputeDomain)
            assert [d.value.uid for d in domains] == ["u1"]
            assert await store.revision() > 0


async def test_the_imex_agent_requests_and_reads_its_certificate(secured: dict[str, EtcdConfig]) -> None:
    async with Store(secured[roles.IMEX_AGENT]) as agent, Store(secured[roles.CONTROLLER]) as controller:
        request = pb.MeshCertificateRequest(domain_uid="u1", node_name="n1", csr_pem=b"csr")
        await agent.put(agent.keys.mesh_request("u1", "n1"), request)
        seen = await controller.get(controller.keys.mesh_request("u1", "n1"), pb.MeshCertificateRequest)
        assert seen is not None and seen.value.csr_pem == b"csr"
        cert = pb.MeshCertificate(domain_uid="u1", node_name="n1", cert_pem=b"cert")
        await controller.put(controller.keys.mesh_certificate("u1", "n1"), cert)
        got, _ = await agent.list(agent.keys.mesh_certificates("u1"), pb.MeshCertificate)
        assert [c.value.cert_pem for c in got] == [b"cert"]


def test_the_printed_etcdctl_commands_leave_the_ca_range_out() -> None:
    commands = roles.etcdctl_commands(PREFIX)
    assert "etcdctl role grant-permission cd-controller readwrite /cd/v1/ /cd/v10" in commands
    assert "etcdctl role grant-permission cd-imex-agent readwrite /cd/v1/ /cd/v1/meshca/" in commands
    assert "etcdctl role grant-permission cd-imex-agent readwrite /cd/v1/meshca0 /cd/v10" in commands
