"""Turning etcd's authentication on with the components' users and roles (libs/state/roles.py).

Users have no password: with client-certificate authentication etcd takes the user from the
certificate's CN. `root` (who runs this) gets the root role; each component its role; operators
(e.g. cdsim's own commands) read and write the whole prefix. Safe to run again: what exists is
kept, and nothing is done once authentication is on. The Helm chart runs it after every install
and upgrade as root (deployments/helm/compute-domains/templates/etcd-roles-job.yaml):

    python -m libs.state.enable_auth --etcd-endpoints=... --etcd-ca-file=... \\
        --etcd-cert-file=<root's> --etcd-key-file=<root's> [--etcd-prefix=/cd/v1/]
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from aetcd import rpc

from libs.runtime.settings import load_settings_or_exit
from libs.state import roles
from libs.state.config import EtcdConfig, EtcdSettings
from libs.state.store import Store

ROOT = "root"
# The whole run, connecting included: a Job that fails is retried by Kubernetes with backoff.
RUN_TIMEOUT_S = 60.0


def _whole_prefix(prefix: str) -> rpc.Permission:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=end.encode())


async def enable_auth(
    auth: rpc.AuthStub, prefix: str, operators: Sequence[str] = (), timeout_s: float = 5.0
) -> bool:
    """Users and roles, then authentication on; False when it was on already."""
    status = await auth.AuthStatus(rpc.AuthStatusRequest(), timeout=timeout_s)
    if status.enabled:
        return False
    existing_roles = set((await auth.RoleList(rpc.AuthRoleListRequest(), timeout=timeout_s)).roles)
    existing_users = set((await auth.UserList(rpc.AuthUserListRequest(), timeout=timeout_s)).users)
    for role in (ROOT, *operators):
        if role not in existing_roles:
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=timeout_s)
    for operator in operators:
        await auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(name=operator, perm=_whole_prefix(prefix)), timeout=timeout_s
        )
    await roles.grant_roles(auth, prefix, timeout_s, skip=existing_roles)
    no_password = rpc.UserAddOptions(no_password=True)
    for user in (ROOT, *operators, *roles.COMPONENTS):
        if user not in existing_users:
            await auth.UserAdd(rpc.AuthUserAddRequest(name=user, options=no_password), timeout=timeout_s)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=user), timeout=timeout_s)
    await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout_s)
    return True


async def enable_auth_at(config: EtcdConfig, operators: Sequence[str] = ()) -> bool:
    """enable_auth through `config` (root's client certificate)."""
    async with Store(config) as store:
        auth = rpc.AuthStub(store.client.channel)
        return await enable_auth(auth, config.prefix, operators, config.timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings_or_exit(
        EtcdSettings, argv, prog="python -m libs.state.enable_auth", description=__doc__.splitlines()[0]
    )
    config = EtcdConfig.from_settings(settings)
    if not (config.tls and config.cert_file):
        print(
            "enable_auth: give root's client certificate (--etcd-ca-file, --etcd-cert-file, --etcd-key-file)"
        )
        return 2
    try:
        changed = asyncio.run(asyncio.wait_for(enable_auth_at(config), RUN_TIMEOUT_S))
    except Exception as exc:  # any failure ends the run with its message; the Job retries
        print(f"enable_auth: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("etcd authentication enabled" if changed else "etcd authentication was on already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
