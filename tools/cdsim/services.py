"""What the supervisor runs: one spec per service process of a simulated cluster (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tools import launch
from tools.cdsim.credentials import Credentials
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import SimConfig
from tools.sim.hardware.cluster import ClusterDescription

AGENT_TARGET = launch.service_target("node-agent")
IMEX_AGENT_TARGET = launch.service_target("imex-agent")
CONTROLLER_TARGET = launch.service_target("controller")
ADVISOR_TARGET = launch.service_target("advisor")
# Imported once by the fork server (see tools.cdsim.zygote).
PRELOAD_MODULES = tuple(launch.SERVICE_MODULES.values())

# Each node's programs serve /healthz on the node's own loopback address: no port is handed out.
AGENT_HEALTH_PORT = 9400
IMEX_AGENT_HEALTH_PORT = 9401
# Short enough that a dead node's record disappears quickly in a demo.
IMEX_AGENT_LEASE_TTL_S = 5
AGENT_KIND = "agent"  # the kubelet plugin
IMEX_AGENT_KIND = "imex-agent"
CONTROLLER_LEASE_TTL_S = 3


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    kind: str  # advisor | controller | agent | imex-agent
    target: str
    argv: list[str]
    health_url: str
    restart_delay_s: float
    node: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ports:
    """Loopback ports chosen by the supervisor at start and kept across restarts."""

    etcd: int
    advisor_grpc: int
    advisor_health: int
    controller_health: tuple[int, ...]
    # Per node: the port of its etcd gate (tools.cdsim.etcd_gate), through which both of the
    # node's programs reach etcd, so that one node can be partitioned from the store. A node
    # without a gate talks to etcd directly.
    node_etcd: Mapping[str, int] = field(default_factory=dict)

    def etcd_endpoint_of(self, node: str) -> str:
        return f"127.0.0.1:{self.node_etcd.get(node, self.etcd)}"


def agent_name(node: str) -> str:
    return f"agent-{node}"


def imex_agent_name(node: str) -> str:
    return f"imex-{node}"


def controller_name(replica: int) -> str:
    return f"controller-{replica}"


ADVISOR_NAME = "advisor"


def _etcd_flags(etcd_endpoint: str) -> list[str]:
    return ["--etcd-endpoint", etcd_endpoint]


def _hardware_flags(layout: StateLayout) -> list[str]:
    return [
        "--hardware", "simulated",
        "--sim-cluster", str(layout.cluster_file),
        "--sim-state-dir", str(layout.nodes_dir),
    ]  # fmt: skip


def agent_spec(
    cluster: ClusterDescription, node: str, layout: StateLayout, config: SimConfig, etcd_endpoint: str
) -> ServiceSpec:
    """The node's kubelet plugin (DRA and registration sockets, checkpoint, CDI)."""
    dirs = layout.node(node)
    address = cluster.node(node).address
    argv = [
        "--node-name", node,
        "--kubelet-dir", str(dirs.kubelet_dir),
        "--cdi-root", str(dirs.cdi_root),
        *_hardware_flags(layout),
        "--claim-source", "store",
        "--health-host", address,
        "--health-port", str(AGENT_HEALTH_PORT),
        "--log-format", "json",
        "--log-level", config.log_level,
        *_etcd_flags(etcd_endpoint),
    ]  # fmt: skip
    return ServiceSpec(
        name=agent_name(node),
        kind=AGENT_KIND,
        target=AGENT_TARGET,
        argv=argv,
        health_url=f"http://{address}:{AGENT_HEALTH_PORT}/healthz",
        restart_delay_s=config.agent_restart_delay_s,
        node=node,
    )


def imex_agent_spec(
    cluster: ClusterDescription, node: str, layout: StateLayout, config: SimConfig, etcd_endpoint: str
) -> ServiceSpec:
    """The node's IMEX side: node record on its lease, the IMEX daemons and their status."""
    dirs = layout.node(node)
    address = cluster.node(node).address
    argv = [
        "--node-name", node,
        "--node-ip", address,
        "--imex-work-dir", str(dirs.imex_dir),
        # Recorded in the node record: where this node's kubelet plugin keeps its sockets and specs.
        "--kubelet-dir", str(dirs.kubelet_dir),
        "--cdi-root", str(dirs.cdi_root),
        *_hardware_flags(layout),
        "--lease-ttl-s", str(IMEX_AGENT_LEASE_TTL_S),
        "--health-host", address,
        "--health-port", str(IMEX_AGENT_HEALTH_PORT),
        "--log-format", "json",
        "--log-level", config.log_level,
        *_etcd_flags(etcd_endpoint),
    ]  # fmt: skip
    return ServiceSpec(
        name=imex_agent_name(node),
        kind=IMEX_AGENT_KIND,
        target=IMEX_AGENT_TARGET,
        argv=argv,
        health_url=f"http://{address}:{IMEX_AGENT_HEALTH_PORT}/healthz",
        restart_delay_s=config.agent_restart_delay_s,
        node=node,
    )


def controller_spec(replica: int, port: int, config: SimConfig, etcd_endpoint: str) -> ServiceSpec:
    argv = [
        "--identity", controller_name(replica),
        "--mode", "simulation",
        "--leader-lease-ttl-s", str(CONTROLLER_LEASE_TTL_S),
        "--health-host", "127.0.0.1",
        "--health-port", str(port),
        "--log-format", "json",
        "--log-level", config.log_level,
        "--imex-mesh-tls", "true" if config.mesh == "tls" else "false",
        "--imex-mesh-certificate-validity-s", str(config.mesh_certificate_validity_s),
        *_etcd_flags(etcd_endpoint),
    ]  # fmt: skip
    return ServiceSpec(
        name=controller_name(replica),
        kind="controller",
        target=CONTROLLER_TARGET,
        argv=argv,
        health_url=f"http://127.0.0.1:{port}/healthz",
        restart_delay_s=config.controller_restart_delay_s,
    )


def advisor_spec(grpc_port: int, health_port: int, config: SimConfig, etcd_endpoint: str) -> ServiceSpec:
    argv = [
        "--identity", ADVISOR_NAME,
        "--grpc-host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        # Simulation has no kube-scheduler to call the extender.
        "--extender-enabled", "false",
        "--health-host", "127.0.0.1",
        "--health-port", str(health_port),
        "--log-format", "json",
        "--log-level", config.log_level,
        *_etcd_flags(etcd_endpoint),
    ]  # fmt: skip
    return ServiceSpec(
        name=ADVISOR_NAME,
        kind="advisor",
        target=ADVISOR_TARGET,
        argv=argv,
        health_url=f"http://127.0.0.1:{health_port}/healthz",
        restart_delay_s=1.0,
    )


def all_specs(
    cluster: ClusterDescription, layout: StateLayout, config: SimConfig, ports: Ports
) -> list[ServiceSpec]:
    etcd = f"127.0.0.1:{ports.etcd}"
    specs = [advisor_spec(ports.advisor_grpc, ports.advisor_health, config, etcd)]
    specs += [controller_spec(i, port, config, etcd) for i, port in enumerate(ports.controller_health)]
    for node in cluster.node_names():
        node_etcd = ports.etcd_endpoint_of(node)
        specs.append(imex_agent_spec(cluster, node, layout, config, node_etcd))
        specs.append(agent_spec(cluster, node, layout, config, node_etcd))
    if config.secure:
        # Kubernetes mode: kube-scheduler calls the extender in plaintext (no client certificate yet).
        credentials = Credentials(layout.pki_dir)
        specs = [with_credentials(s, credentials, advisor_mtls=not config.kubernetes) for s in specs]
    return specs


def with_credentials(spec: ServiceSpec, credentials: Credentials, *, advisor_mtls: bool) -> ServiceSpec:
    """`spec` reaching etcd over TLS as its own identity; the advisor also serving mutual TLS."""
    argv = [*spec.argv, *credentials.etcd_flags(spec.kind)]
    if spec.kind == "advisor" and advisor_mtls:
        argv += credentials.advisor_flags()
    return replace(spec, argv=argv)
