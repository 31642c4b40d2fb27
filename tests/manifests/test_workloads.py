"""The workloads: what each service is started with, where it finds the host, how it is probed."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

from libs.runtime.settings import load_settings
from services.advisor.settings import AdvisorSettings
from services.controller.settings import ControllerSettings
from services.imexagent.settings import ImexAgentSettings
from services.nodeagent.settings import AgentSettings
from tests.manifests.objects import (
    NAMESPACE,
    PRIORITY_CLASSES,
    Obj,
    container,
    find,
    flags,
    host_path_mounts,
    mounts,
    of_kind,
    pod_spec,
    undefined_references,
)
from tools.sim.hardware.cluster import ClusterDescription

IN_CLUSTER_ETCD = f"cd-etcd.{NAMESPACE}.svc:2379"
HA_ETCD_MEMBERS = ",".join(f"cd-etcd-{i}.cd-etcd.{NAMESPACE}.svc:2379" for i in range(3))
TLS_FLAGS = ("--etcd-ca-file", "--etcd-cert-file", "--etcd-key-file")
# The node agent's Kubernetes mode is where its claims come from.
KUBERNETES_MODE_FLAG = {
    "cd-controller": "--mode",
    "cd-placement-advisor": "--template-source",
    "cd-node-agent": "--claim-source",
}
WORKLOADS = [
    ("Deployment", "cd-controller"),
    ("Deployment", "cd-placement-advisor"),
    ("DaemonSet", "cd-node-agent"),
    ("DaemonSet", "cd-imex-agent"),
]


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def port_number(c: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(int(p["containerPort"]) for p in c["ports"] if p["name"] == name_or_number)


# --- every workload ----------------------------------------------------------------------------


def test_selectors_match_their_pod_templates(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in of_kind(objects, "Service") + of_kind(objects, "PodDisruptionBudget"):
        selector = service["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        selected = [
            w
            for w in workloads(objects)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, (
            f"{service['kind']} {service['metadata']['name']} selects {len(selected)} workloads"
        )


@pytest.mark.parametrize(
    ("kind", "name", "settings_class"),
    [
        ("Deployment", "cd-controller", ControllerSettings),
        ("Deployment", "cd-placement-advisor", AdvisorSettings),
        ("DaemonSet", "cd-node-agent", AgentSettings),
        ("DaemonSet", "cd-imex-agent", ImexAgentSettings),
    ],
)
def test_services_accept_the_flags_they_are_given(
    tree: tuple[str, list[Obj]], kind: str, name: str, settings_class: type
) -> None:
    """A flag the service does not declare, or a bad value, would stop it at start-up."""
    c = container(find(tree[1], kind, name))
    argv = [f"{flag}={value}" for flag, value in flags(c).items()]
    load_settings(settings_class, argv, env={})


def test_every_flag_is_well_formed_and_every_variable_defined(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    for workload in workloads(objects):
        for c in pod_spec(workload)["containers"]:
            assert undefined_references(c) == [], (
                f"{workload['metadata']['name']}: kubelet would pass these literally"
            )
            if workload["kind"] != "StatefulSet":  # etcd has its own flag style
                flags(c)  # asserts --name=value and no flag twice


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_services_run_in_kubernetes_mode_and_probe_their_health_port(
    tree: tuple[str, list[Obj]], kind: str, name: str
) -> None:
    _, objects = tree
    workload = find(objects, kind, name)
    c = container(workload)
    given = flags(c)
    if name in KUBERNETES_MODE_FLAG:  # the IMEX agent never talks to the API server
        assert given[KUBERNETES_MODE_FLAG[name]] == "kubernetes"
    health_port = int(given["--health-port"])
    # The IMEX agent has no liveness probe (a restart would restart the node's daemons).
    probes = (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"))
    for probe, path in probes if name != "cd-imex-agent" else probes[1:]:
        http = c[probe]["httpGet"]
        assert http["path"] == path and port_number(c, http["port"]) == health_port, f"{name} {probe}"
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == health_port
    assert annotations["prometheus.io/path"] == "/metrics"


# --- controller and advisor --------------------------------------------------------------------


def test_controller_runs_two_replicas_one_leading(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    controller = find(objects, "Deployment", "cd-controller")
    assert controller["spec"]["replicas"] == 2
    assert container(controller)["command"] == ["cd-controller"]
    pdb = find(objects, "PodDisruptionBudget", "cd-controller")
    assert pdb["spec"]["maxUnavailable"] == 1
    anti = pod_spec(controller)["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_advisor_service_exposes_grpc_and_extender_ports(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    advisor = find(objects, "Deployment", "cd-placement-advisor")
    c = container(advisor)
    assert c["command"] == ["cd-placement-advisor"]
    given = flags(c)
    service = find(objects, "Service", "cd-placement-advisor")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "extender"}
    assert port_number(c, ports["grpc"]["targetPort"]) == int(given["--grpc-port"])
    assert port_number(c, ports["extender"]["targetPort"]) == int(given["--extender-port"])


@pytest.mark.parametrize("name", ["cd-controller", "cd-placement-advisor"])
def test_control_plane_services_run_unprivileged(tree: tuple[str, list[Obj]], name: str) -> None:
    _, objects = tree
    workload = find(objects, "Deployment", name)
    assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
    security = container(workload)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
    assert not pod_spec(workload).get("hostNetwork")


# --- node agent ----------------------------------------------------------------------------


@pytest.fixture
def agent(tree: tuple[str, list[Obj]]) -> Obj:
    return find(tree[1], "DaemonSet", "cd-node-agent")


def test_node_agent_is_privileged_on_the_host_network(agent: Obj) -> None:
    spec = pod_spec(agent)
    assert container(agent)["securityContext"]["privileged"] is True
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"  # still resolves the etcd Service


def test_node_agent_mounts_the_host_directories(agent: Obj) -> None:
    c = container(agent)
    host = host_path_mounts(agent, c)
    host.pop("/var/lib/computedomains/sim", None)  # the sim overlay's simulated hardware
    assert set(host) == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
        "/run/nvidia/driver",
        "/dev",
    }
    assert host["/var/lib/kubelet/plugins"][0]["mountPropagation"] == "Bidirectional"
    driver_root = host["/run/nvidia/driver"][0]
    assert driver_root["readOnly"] is True and driver_root["mountPropagation"] == "HostToContainer"
    for path in ("/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"):
        assert not host[path][0].get("readOnly"), f"{path} must be writable"


def test_node_agent_flags_point_where_the_host_is_mounted(agent: Obj) -> None:
    """Kubelet finds our sockets, and containers our CDI specs, only if the agent writes where
    the host's directories are mounted."""
    c = container(agent)
    given = flags(c)
    host = {path: mount["mountPath"] for path, (mount, _) in host_path_mounts(agent, c).items()}
    kubelet_dir = PurePosixPath(given["--kubelet-dir"])
    assert host["/var/lib/kubelet/plugins_registry"] == str(kubelet_dir / "plugins_registry")
    assert host["/var/lib/kubelet/plugins"] == str(kubelet_dir / "plugins")
    assert host["/var/run/cdi"] == given["--cdi-root"]
    # --driver-root is the root the host's /dev shows under: channel device nodes are created
    # there and CDI specs name them by their host paths.
    assert host["/dev"] == "/dev" == str(PurePosixPath(given["--driver-root"]) / "dev")


def test_node_agent_knows_its_node(agent: Obj) -> None:
    c = container(agent)
    given = flags(c)
    assert c["command"] == ["cd-node-agent"]
    assert given["--node-name"] == "<spec.nodeName>"
    assert given["--publish-clique-label"] == "true"
    # The plugin runs no IMEX daemon and holds no lease.
    assert not {"--node-ip", "--imex-work-dir", "--lease-ttl-s", "--nvidia-imex-binary"} & set(given)


def test_node_agent_rolls_freely(agent: Obj) -> None:
    assert agent["spec"]["updateStrategy"]["type"] == "RollingUpdate"


# --- IMEX agent ----------------------------------------------------------------------------


@pytest.fixture
def imex_agent(tree: tuple[str, list[Obj]]) -> Obj:
    return find(tree[1], "DaemonSet", "cd-imex-agent")


def test_imex_agent_is_replaced_only_when_its_pod_is_deleted(imex_agent: Obj) -> None:
    """A new IMEX agent container restarts the node's daemons, which breaks running jobs."""
    assert imex_agent["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert "livenessProbe" not in container(imex_agent)


def test_imex_agent_runs_daemons_on_the_host_network_from_a_host_work_dir(imex_agent: Obj) -> None:
    spec = pod_spec(imex_agent)
    c = container(imex_agent)
    given = flags(c)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert c["command"] == ["cd-imex-agent"]
    assert given["--node-name"] == "<spec.nodeName>"
    assert given["--node-ip"] == "<status.hostIP>"
    host = {path: mount["mountPath"] for path, (mount, _) in host_path_mounts(imex_agent, c).items()}
    assert host["/var/lib/computedomains/imex"] == given["--imex-work-dir"]
    driver_root = PurePosixPath(host["/run/nvidia/driver"])
    for tool in ("--nvidia-imex-binary", "--nvidia-imex-ctl-binary"):
        assert driver_root in PurePosixPath(given[tool]).parents, f"{tool} is not in the driver root"


def test_imex_agent_has_no_kubernetes_credentials(tree: tuple[str, list[Obj]], imex_agent: Obj) -> None:
    assert pod_spec(imex_agent)["automountServiceAccountToken"] is False
    account = pod_spec(imex_agent)["serviceAccountName"]
    bound = [
        b
        for b in tree[1]
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s.get("name") == account for s in b.get("subjects", []))
    ]
    assert bound == []


def test_node_agent_has_a_patient_startup_probe(agent: Obj) -> None:
    c = container(agent)
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    # A node agent waits for the GPU driver and fabric; give it minutes before liveness counts.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


# --- overlays ------------------------------------------------------------------------------


def test_base_expects_the_in_cluster_etcd_and_real_gpus(base: list[Obj]) -> None:
    for kind, name in WORKLOADS:
        given = flags(container(find(base, kind, name)))
        assert given["--etcd-endpoint"] == IN_CLUSTER_ETCD
        assert not set(TLS_FLAGS) & set(given)
    assert flags(container(find(base, "DaemonSet", "cd-node-agent")))["--hardware"] == "nvml"


def test_production_gives_every_component_all_etcd_members_and_its_own_certificate(
    production: list[Obj],
) -> None:
    secrets = set()
    for kind, name in WORKLOADS:
        workload = find(production, kind, name)
        c = container(workload)
        given = flags(c)
        assert given["--etcd-endpoint"] == HA_ETCD_MEMBERS, name
        mounted = mounts(workload, c)
        for flag in TLS_FLAGS:
            directory = str(PurePosixPath(given[flag]).parent)
            mount, volume = mounted[directory]
            assert mount["readOnly"] is True
            secrets.add(volume["secret"]["secretName"])
            key = PurePosixPath(given[flag]).name
            assert key in ("ca.crt", "tls.crt", "tls.key")
    assert len(secrets) == len(WORKLOADS), "each component has its own client certificate"


def etcd_flags(etcd: Obj) -> dict[str, str]:
    command = container(etcd)["command"]
    assert command[0] == "etcd"
    return {arg.partition("=")[0]: arg.partition("=")[2] for arg in command[1:]}


def test_production_runs_a_three_member_etcd_with_peer_and_client_tls(production: list[Obj]) -> None:
    etcd = find(production, "StatefulSet", "cd-etcd")
    service = find(production, "Service", "cd-etcd")
    spec = etcd["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # members meet before they are ready
    given = etcd_flags(etcd)
    # The initial cluster is the three stable names, and the services are given exactly them.
    peers = dict(member.split("=", 1) for member in given["--initial-cluster"].split(","))
    names = [f"cd-etcd-{i}" for i in range(3)]
    assert list(peers) == names
    assert peers == {n: f"https://{n}.cd-etcd.{NAMESPACE}.svc:2380" for n in names}
    assert HA_ETCD_MEMBERS == ",".join(f"{n}.cd-etcd.{NAMESPACE}.svc:2379" for n in names)
    assert given["--advertise-client-urls"] == f"https://$(POD_NAME).cd-etcd.{NAMESPACE}.svc:2379"
    assert given["--listen-client-urls"].startswith("https://")
    assert given["--listen-peer-urls"].startswith("https://")
    # Client and peer TLS from the operator's Secrets, certificates required on both.
    assert "--client-cert-auth" in given and "--peer-client-cert-auth" in given
    mounted = mounts(etcd, container(etcd))
    for flag, secret in (
        ("--cert-file", "cd-etcd-server-tls"),
        ("--key-file", "cd-etcd-server-tls"),
        ("--trusted-ca-file", "cd-etcd-server-tls"),
        ("--peer-cert-file", "cd-etcd-peer-tls"),
        ("--peer-key-file", "cd-etcd-peer-tls"),
        ("--peer-trusted-ca-file", "cd-etcd-peer-tls"),
    ):
        mount, volume = mounted[str(PurePosixPath(given[flag]).parent)]
        assert mount["readOnly"] is True and volume["secret"]["secretName"] == secret, flag
    # One member per node, and a drain never takes two.
    anti = pod_spec(etcd)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [term["topologyKey"] for term in anti] == ["kubernetes.io/hostname"]
    assert (
        anti[0]["labelSelector"]["matchLabels"].items()
        <= etcd["spec"]["template"]["metadata"]["labels"].items()
    )
    pdb = find(production, "PodDisruptionBudget", "cd-etcd")
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_production_node_agent_runs_on_gpu_nodes_with_nvml(production: list[Obj]) -> None:
    agent = find(production, "DaemonSet", "cd-node-agent")
    assert pod_spec(agent)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert flags(container(agent))["--hardware"] == "nvml"


def test_sim_runs_its_own_etcd_where_the_services_look_for_it(sim: list[Obj]) -> None:
    etcd = find(sim, "StatefulSet", "cd-etcd")
    service = find(sim, "Service", "cd-etcd")
    assert etcd["spec"]["replicas"] == 1 and etcd["spec"]["serviceName"] == "cd-etcd"
    client_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    assert IN_CLUSTER_ETCD == f"{service['metadata']['name']}.{NAMESPACE}.svc:{client_port}"
    for kind, name in WORKLOADS:
        given = flags(container(find(sim, kind, name)))
        assert given["--etcd-endpoint"] == IN_CLUSTER_ETCD
        assert not set(TLS_FLAGS) & set(given)
    etcd_container = container(etcd)
    assert "--data-dir=/var/lib/etcd/data" in etcd_container["command"]
    assert "/var/lib/etcd" in mounts(etcd, etcd_container)


def test_sim_node_agent_uses_the_simulated_cluster_it_mounts(sim: list[Obj]) -> None:
    agent = find(sim, "DaemonSet", "cd-node-agent")
    c = container(agent)
    given = flags(c)
    assert given["--hardware"] == "simulated"
    cluster_file = PurePosixPath(given["--sim-cluster"])
    _, volume = mounts(agent, c)[str(cluster_file.parent)]
    config_map = find(sim, "ConfigMap", volume["configMap"]["name"])
    cluster = ClusterDescription.from_json(config_map["data"][cluster_file.name])
    assert cluster.node_count == 36
    assert given["--sim-state-dir"] in mounts(agent, c)


def test_priority_classes_keep_our_pods_from_being_preempted_by_workloads(
    tree: tuple[str, list[Obj]],
) -> None:
    _, objects = tree
    assert {
        name: pod_spec(find(objects, kind, name)).get("priorityClassName") for kind, name in WORKLOADS
    } == PRIORITY_CLASSES
