"""Store records as the services write them, for feeding the dashboard directly."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from tools.sim.hardware.cluster import ClusterDescription

READY = pb.Readiness.READY
NOT_READY = pb.Readiness.NOT_READY


def node(cluster: ClusterDescription, name: str) -> pb.Node:
    sim = cluster.node(name)
    return pb.Node(
        name=name,
        ip_address=sim.address,
        clique_id=sim.clique,
        cluster_uuid=sim.cluster_uuid,
        health=pb.Health.HEALTHY,
    )


def domain(
    uid: str,
    name: str,
    *,
    namespace: str = "default",
    ready: bool = False,
    reason: str = "WaitingForNodes",
    message: str = "",
    nodes: dict[str, bool] | None = None,
    created_unix_ms: int = 1,
) -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid=uid,
        namespace=namespace,
        name=name,
        spec=pb.ComputeDomainSpec(num_nodes=len(nodes or {})),
        status=pb.ComputeDomainStatus(
            status=READY if ready else NOT_READY,
            nodes=[
                pb.NodeStatus(name=n, status=READY if ok else NOT_READY) for n, ok in (nodes or {}).items()
            ],
            conditions=[
                pb.Condition(
                    type="Ready", status="True" if ready else "False", reason=reason, message=message
                )
            ],
        ),
        created_unix_ms=created_unix_ms,
        source="simulation",
    )


def member(cluster: ClusterDescription, uid: str, name: str, index: int, *, lost: bool = False) -> pb.Member:
    sim = cluster.node(name)
    return pb.Member(
        domain_uid=uid,
        node_name=name,
        clique_id=sim.clique,
        index=-1 if lost else index,
        state=pb.MemberState.LOST if lost else pb.MemberState.ACTIVE,
        ip_address=sim.address,
        namespace="default",
        joined_unix_ms=1,
    )


def daemon(
    uid: str, name: str, state: pb.DaemonState, *, error: str = "", log: list[str] | None = None
) -> pb.DaemonStatus:
    return pb.DaemonStatus(
        domain_uid=uid, node_name=name, state=state, last_error=error, last_log_lines=list(log or [])
    )
