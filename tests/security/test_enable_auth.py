"""libs/state/enable_auth.py on a real etcd: it finishes what an interrupted run began (roles and
users that exist are kept), every component gets its user and the ranges of libs/state/roles.py,
an operator the whole prefix. tests/k8s/test_helm_services.py runs it twice, as the chart does (with
root's certificate): the second run finds authentication on."""

from __future__ import annotations

import secrets
from pathlib import Path

from aetcd import rpc

from libs.state import enable_auth, roles
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.etcd.server import EtcdServer

PREFIX = "/cd/v1/"


async def test_an_interrupted_run_is_finished(etcd_bin: Path, tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "etcd", binary=etcd_bin)
    server.start()
    password = secrets.token_hex(8)
    try:
        async with Store(EtcdConfig(endpoint=server.endpoint, prefix=PREFIX)) as store:
            auth = rpc.AuthStub(store.client.channel)
            # What a run that died half-way left (root with a password, so this test can log in).
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=enable_auth.ROOT), timeout=5)
            await auth.UserAdd(rpc.AuthUserAddRequest(name=enable_auth.ROOT, password=password), timeout=5)
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=roles.NODE_AGENT), timeout=5)
            assert await enable_auth.enable_auth(auth, PREFIX, operators=("operator",))
        async with Store(EtcdConfig(endpoint=server.endpoint, prefix=PREFIX)) as store:
            auth = rpc.AuthStub(store.client.channel)
            login = await auth.Authenticate(
                rpc.AuthenticateRequest(name=enable_auth.ROOT, password=password), timeout=5
            )
            as_root = (("token", login.token),)
            assert (await auth.AuthStatus(rpc.AuthStatusRequest(), timeout=5, metadata=as_root)).enabled
            for component in roles.COMPONENTS:
                role = await auth.RoleGet(rpc.AuthRoleGetRequest(role=component), timeout=5, metadata=as_root)
                granted = [(p.key, p.range_end) for p in role.perm]
                assert granted == [(r.key, r.range_end) for r in roles.ranges(component, PREFIX)], component
                user = await auth.UserGet(rpc.AuthUserGetRequest(name=component), timeout=5, metadata=as_root)
                assert list(user.roles) == [component]
            operator = await auth.RoleGet(
                rpc.AuthRoleGetRequest(role="operator"), timeout=5, metadata=as_root
            )
            assert [(p.key, p.range_end) for p in operator.perm] == [(b"/cd/v1/", b"/cd/v10")]
    finally:
        server.destroy()
