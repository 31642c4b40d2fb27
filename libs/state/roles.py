"""The etcd roles of the components: what each identity may read and write.

Every component works under one key prefix. The controller alone may read the IMEX mesh CAs
(``meshca/``): a CA key lets whoever holds it mint certificates for the domain. The others get
the prefix without that range (etcd permissions only add up, so "all but meshca/" is two
ranges). The identity is the etcd user: the client certificate's CN with client-certificate auth,
or a user name and password.

``python -m libs.state.roles --prefix /cd/v1/`` prints the etcdctl commands that create the roles.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Set
from dataclasses import dataclass

from aetcd import rpc

from libs.state.keys import Keys

# etcd user (= client certificate CN) of each component, as the production overlay names them.
CONTROLLER = "cd-controller"
NODE_AGENT = "cd-node-agent"
IMEX_AGENT = "cd-imex-agent"
ADVISOR = "cd-placement-advisor"
COMPONENTS = (CONTROLLER, NODE_AGENT, IMEX_AGENT, ADVISOR)


@dataclass(frozen=True)
class KeyRange:
    key: bytes
    range_end: bytes

    def etcdctl(self) -> str:
        return f"{self.key.decode()} {self.range_end.decode()}"


def _end_of(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def ranges(component: str, prefix: str = "/cd/v1/") -> list[KeyRange]:
    """The READWRITE ranges of `component` under `prefix`."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; one of {', '.join(COMPONENTS)}")
    whole = prefix.encode()
    if component == CONTROLLER:
        return [KeyRange(whole, _end_of(whole))]
    ca = Keys(prefix).mesh_authorities().encode()
    return [KeyRange(whole, ca), KeyRange(_end_of(ca), _end_of(whole))]


async def grant_roles(
    auth: rpc.AuthStub, prefix: str, timeout_s: float = 5.0, skip: Set[str] = frozenset()
) -> None:
    """One role per component (named like its user) with its ranges; roles in `skip` exist already
    (their ranges are granted again, which etcd takes as a no-op)."""
    for component in COMPONENTS:
        if component not in skip:
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=component), timeout=timeout_s)
        for r in ranges(component, prefix):
            permission = rpc.Permission(permType=rpc.Permission.READWRITE, key=r.key, range_end=r.range_end)
            await auth.RoleGrantPermission(
                rpc.AuthRoleGrantPermissionRequest(name=component, perm=permission), timeout=timeout_s
            )


def etcdctl_commands(prefix: str) -> list[str]:
    out: list[str] = []
    for component in COMPONENTS:
        out.append(f"etcdctl role add {component}")
        out += [
            f"etcdctl role grant-permission {component} readwrite {r.etcdctl()}"
            for r in ranges(component, prefix)
        ]
        out.append(f"etcdctl user add {component} --no-password")
        out.append(f"etcdctl user grant-role {component} {component}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.state.roles", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="/cd/v1/", help="the deployment's key prefix (--etcd-prefix)")
    args = parser.parse_args(argv)
    if not args.prefix.endswith("/"):
        print(f"--prefix must end with '/', got {args.prefix!r}", file=sys.stderr)
        return 2
    print("\n".join(etcdctl_commands(args.prefix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
