"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

Every container's command must be a real entry point of the package whose flags and CD_*
environment parse with that program's own settings class; the topology (names, counts, targets,
settings) must be the one `cdsim up` runs for the same cluster; each node's IMEX agent must own
the node's address and its kubelet plugin share it; health checks must hit each program's own
/healthz; the simulated hardware baked into the image must be what both programs of a node open
(one state volume per node); and the real etcd must start with the compose flags.
"""

from __future__ import annotations

import dataclasses
import importlib
import ipaddress
import re
import shlex
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.runtime.settings import load_settings
from tools import launch
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState, SimConfig
from tools.cdsim.services import Ports, all_specs
from tools.dashboard.cdsim_hook import dashboard_spec
from tools.etcd.server import etcd_binary
from tools.gen_settings_docs import settings_of_entry_point
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import SimulatedNodeHardware

REPO = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (REPO / "Dockerfile").read_text()
JOBS = "jobs"  # where `cdsim job` runs against the cluster (it idles otherwise)
PROGRAMS = [name for name in SERVICES if name not in ("etcd", JOBS)]
SIM_DIR = "/var/lib/cdsim"  # inside the image (Dockerfile ENV CD_SIM_DIR)
PLUGIN_TARGET = launch.service_target("node-agent")
IMEX_AGENT_TARGET = launch.service_target("imex-agent")

# Settings that legitimately differ between a container and a cdsim process on loopback: where
# things listen and where files live. Everything else must be what cdsim runs.
DEPLOYMENT_FIELDS = {
    "etcd_endpoint",
    "health_host",
    "health_port",
    "grpc_host",
    "grpc_port",
    "node_ip",
    "kubelet_dir",
    "cdi_root",
    "imex_work_dir",
    "sim_cluster",
    "sim_state_dir",
    "host",
    "port",
    "title",
}


@dataclass(frozen=True)
class Program:
    target: str  # module:function
    argv: list[str]
    settings_class: type
    env_prefix: str

    def settings(self, environment: dict[str, str]) -> Any:
        return load_settings(self.settings_class, self.argv, env=environment, env_prefix=self.env_prefix)


def console_scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def program(service: str) -> Program:
    command = SERVICES[service]["command"]
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), (
        f"{service}: command must be an exec-form list of strings"
    )
    scripts = console_scripts()
    if command[0] in scripts:
        target, argv = scripts[command[0]], command[1:]
    elif command[:2] == ["python", "-m"]:
        module_name, argv = command[2], command[3:]
        source = Path(importlib.import_module(module_name).__file__ or "").read_text()
        assert re.search(r'^if __name__ == "__main__":\n\s+main\(\)', source, re.M), (
            f"{service}: `python -m {module_name}` does not run {module_name}.main()"
        )
        target = f"{module_name}:main"
    else:
        raise AssertionError(
            f"{service}: {command[0]!r} is neither a console script of pyproject.toml nor python -m"
        )
    module_name, _, function = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, function)), f"{service}: {target} is not callable"
    settings_class, prefix = settings_of_entry_point(target)
    return Program(target, list(argv), settings_class, prefix)


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    assert isinstance(env, dict), f"{service}: environment must be a mapping"
    return {str(k): str(v) for k, v in env.items()}


def dockerfile_arg(name: str) -> int:
    match = re.search(rf"^ARG {name}=(\d+)$", DOCKERFILE, re.M)
    assert match, f"Dockerfile has no ARG {name}=<n>"
    return int(match.group(1))


def simulated_cluster() -> ClusterDescription:
    return ClusterDescription(racks=dockerfile_arg("SIM_RACKS"), trays_per_rack=dockerfile_arg("SIM_TRAYS"))


def cdsim_specs(tmp_path: Path) -> dict[str, Any]:
    cluster = simulated_cluster()
    config = SimConfig(racks=cluster.racks, trays_per_rack=cluster.trays_per_rack)
    layout = StateLayout.at(tmp_path)
    ports = Ports(
        etcd=2379, advisor_grpc=1, advisor_health=2, controller_health=tuple(range(3, 3 + config.controllers))
    )
    specs = all_specs(cluster, layout, config, ports)
    specs.append(dashboard_spec(layout, config, "127.0.0.1:2379", 4))
    return {spec.name: spec for spec in specs}


def health_url(service: str) -> str:
    test = SERVICES[service]["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else str(test)
    match = re.search(r"https?://[^'\" ]+", text)
    assert match, f"{service}: the health check names no URL: {test}"
    return match.group(0)


@pytest.mark.parametrize("service", PROGRAMS)
def test_every_command_is_an_entry_point_whose_flags_and_environment_parse(service: str) -> None:
    prog = program(service)
    env = environment(service)
    fields = {f.name for f in dataclasses.fields(prog.settings_class)}
    for name in env:
        assert name.startswith(prog.env_prefix) and name[len(prog.env_prefix) :].lower() in fields, (
            f"{service}: {name} is not a setting of {prog.settings_class.__name__} "
            f"(its variables are {prog.env_prefix}<FIELD>)"
        )
    settings = prog.settings(env)
    # Every program finds etcd by its service name, on the port etcd listens on.
    assert settings.etcd_endpoint == "etcd:2379"


def test_the_topology_and_settings_are_what_cdsim_runs(tmp_path: Path) -> None:
    specs = cdsim_specs(tmp_path)
    assert sorted(PROGRAMS) == sorted(specs), "compose services and cdsim processes differ"
    for service in PROGRAMS:
        spec = specs[service]
        prog = program(service)
        assert prog.target == spec.target, f"{service}: runs {prog.target}, cdsim runs {spec.target}"
        ours = dataclasses.asdict(prog.settings(environment(service)))
        theirs = dataclasses.asdict(
            load_settings(prog.settings_class, spec.argv, env={}, env_prefix=prog.env_prefix)
        )
        differ = {k for k in ours if ours[k] != theirs[k]} - DEPLOYMENT_FIELDS
        assert not differ, f"{service}: settings differ from cdsim's: " + ", ".join(
            f"{k}={ours[k]!r} (cdsim {theirs[k]!r})" for k in sorted(differ)
        )
    kinds = [specs[s].kind for s in PROGRAMS]
    assert (kinds.count("controller"), kinds.count("advisor"), kinds.count("dashboard")) == (2, 1, 1)
    nodes = simulated_cluster().node_count
    assert (kinds.count("agent"), kinds.count("imex-agent")) == (nodes, nodes)


def programs_running(target: str) -> dict[str, str]:
    """node name -> the compose service running ``target`` for that node."""
    found: dict[str, str] = {}
    for service in PROGRAMS:
        prog = program(service)
        if prog.target == target:
            node = prog.settings(environment(service)).node_name
            assert node not in found, f"{service} and {found[node]} both run {target} for {node}"
            found[node] = service
    return found


def test_each_node_imex_agent_owns_its_own_address_on_the_network() -> None:
    subnet = ipaddress.ip_network(COMPOSE["networks"]["cdnet"]["ipam"]["config"][0]["subnet"])
    imex_agents = programs_running(IMEX_AGENT_TARGET)
    assert sorted(imex_agents) == sorted(simulated_cluster().node_names())
    addresses = []
    for node, service in imex_agents.items():
        settings = program(service).settings(environment(service))
        network = SERVICES[service]["networks"]["cdnet"]
        # IMEX peers dial the address in the node record, where this container's daemons listen.
        assert settings.node_ip == network["ipv4_address"], (
            f"{service}: IMEX peers would dial another address"
        )
        assert ipaddress.ip_address(settings.node_ip) in subnet
        assert network["aliases"] == [node] == [SERVICES[service]["hostname"]]
        assert service == f"imex-{node}"
        addresses.append(settings.node_ip)
    assert len(set(addresses)) == len(addresses)


def test_each_node_imex_agent_may_give_its_daemons_their_own_mount_namespace() -> None:
    """Every daemon, simulated too, gets the domain's hosts file over /etc/hosts in a mount
    namespace of its own: CAP_SYS_ADMIN, and mount(2), which Docker's default AppArmor profile
    forbids. Nothing more: `privileged` fails on a host whose bounding set lacks a capability."""
    agents = programs_running(IMEX_AGENT_TARGET).values()
    assert agents
    for name in agents:
        assert SERVICES[name]["cap_add"] == ["SYS_ADMIN"]
        assert SERVICES[name]["security_opt"] == ["apparmor=unconfined"]
        assert "privileged" not in SERVICES[name]


def test_each_node_plugin_shares_its_imex_agents_address_and_starts_after_it() -> None:
    plugins = programs_running(PLUGIN_TARGET)
    imex_agents = programs_running(IMEX_AGENT_TARGET)
    assert sorted(plugins) == sorted(imex_agents)
    for node, service in plugins.items():
        owner = imex_agents[node]
        assert service == f"agent-{node}"
        # One network namespace per node, owned by the IMEX agent: a plugin restart leaves the
        # node's address (and so its daemons' connections) alone.
        assert SERVICES[service]["network_mode"] == f"service:{owner}"
        assert "networks" not in SERVICES[service] and "hostname" not in SERVICES[service]
        assert SERVICES[service]["depends_on"][owner]["condition"] == "service_started"
        # Same namespace: the two health servers need distinct ports.
        ports = {program(s).settings(environment(s)).health_port for s in (service, owner)}
        assert len(ports) == 2, f"{service} and {owner} serve health on the same port"


@pytest.mark.parametrize("service", PROGRAMS)
def test_health_checks_hit_the_programs_own_healthz(service: str) -> None:
    settings = program(service).settings(environment(service))
    port = getattr(settings, "health_port", None) or settings.port
    assert health_url(service) == f"http://127.0.0.1:{port}/healthz"
    host = getattr(settings, "health_host", None) or settings.host
    assert host == "0.0.0.0", f"{service}: its health server must listen beyond the container's loopback"
    assert SERVICES[service]["depends_on"]["etcd"]["condition"] == "service_healthy"


def test_every_container_runs_the_one_image() -> None:
    assert {s["image"] for s in SERVICES.values()} == {"computedomains:dev"}
    assert {s["build"]["dockerfile"] for s in SERVICES.values()} == {"Dockerfile"}
    # The image has etcd on PATH (the static binary tools/image/build.sh builds from tools/etcd and
    # stages in the context) and the package installed with the pins.
    assert re.search(r"^COPY build/image/etcd /usr/local/bin/etcd$", DOCKERFILE, re.M)
    assert re.search(r"/pip install -c constraints\.txt \\$", DOCKERFILE, re.M)
    assert re.search(r"/pip install --no-deps -c constraints\.txt \. \\$", DOCKERFILE, re.M)
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for needed in ("libs", "services", "tools", "pyproject.toml", "constraints.txt"):
        assert needed not in ignored
    assert "!build/image/etcd" in ignored
    # No image but the base: a machine without a registry builds it from a local base.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", DOCKERFILE, re.M)
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", DOCKERFILE, re.M)
    named = {name for _, name in stages if name}
    assert stages and all(source in ("${BASE_IMAGE}", *named) for source, _ in stages), stages


def test_the_image_bakes_the_simulated_hardware_the_agents_open(tmp_path: Path) -> None:
    match = re.search(r"^ENV CD_SIM_DIR=(\S+)$", DOCKERFILE, re.M)
    assert match and match.group(1) == SIM_DIR
    [step] = [line for line in DOCKERFILE.splitlines() if line.startswith("RUN python -c ")]
    code = shlex.split(step.removeprefix("RUN "))[2]
    baked = tmp_path / "image"
    env = {
        "CD_SIM_DIR": str(baked),
        "SIM_RACKS": str(dockerfile_arg("SIM_RACKS")),
        "SIM_TRAYS": str(dockerfile_arg("SIM_TRAYS")),
        "PYTHONPATH": str(REPO),
    }
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path, timeout=60)

    def in_image(path: str) -> Path:
        assert path.startswith(SIM_DIR + "/"), f"{path} is not under the image's {SIM_DIR}"
        return baked / path.removeprefix(SIM_DIR + "/")

    opened: dict[str, list[str]] = {}
    for service in PROGRAMS:
        settings = program(service).settings(environment(service))
        if hasattr(settings, "sim_cluster") and settings.sim_cluster:
            assert in_image(settings.sim_cluster).is_file()
        if getattr(settings, "hardware", "") == "simulated":
            hardware = SimulatedNodeHardware.from_cluster_file(
                in_image(settings.sim_cluster), settings.node_name, in_image(settings.sim_state_dir)
            )
            assert hardware.imex_channel_major() == simulated_cluster().imex_channel_major
            assert hardware.clique().clique_id == simulated_cluster().node(settings.node_name).clique
            opened.setdefault(settings.node_name, []).append(node_state_volume(service, settings))
    # Both programs of every node open its hardware, through one volume of that node's own.
    assert sorted(opened) == sorted(simulated_cluster().node_names())
    for node, volumes in opened.items():
        assert len(volumes) == 2 and len(set(volumes)) == 1, f"{node}: state volumes {volumes}"
    assert len({v[0] for v in opened.values()}) == len(opened)


def node_state_volume(service: str, settings: Any) -> str:
    """The named volume mounted at the node's simulated state directory (faults and channel
    devices written by one of the node's programs are seen by the other)."""
    state_dir = f"{settings.sim_state_dir}/{settings.node_name}"
    mounts = [v.split(":") for v in SERVICES[service].get("volumes", [])]
    [volume] = [source for source, target, *_ in mounts if target == state_dir] or [""]
    assert volume in COMPOSE["volumes"], f"{service}: no named volume at {state_dir}"
    return volume


def test_etcd_starts_with_the_compose_flags(tmp_path: Path) -> None:
    """The same etcd (tools/etcd) with the compose flags; only ports, hosts and the data dir moved."""
    command = SERVICES["etcd"]["command"]
    assert command[0] == "etcd"
    client, peer = free_port(), free_port()
    argv = []
    for arg in command[1:]:
        arg = arg.replace("0.0.0.0:2379", f"127.0.0.1:{client}").replace("etcd:2379", f"127.0.0.1:{client}")
        arg = arg.replace("127.0.0.1:2380", f"127.0.0.1:{peer}")
        arg = arg.replace("/var/lib/etcd", str(tmp_path / "etcd"))
        argv.append(arg)
    assert f"--data-dir={tmp_path / 'etcd'}" in argv
    # The compose data dir is the volume's mount point.
    assert "etcd-data:/var/lib/etcd" in SERVICES["etcd"]["volumes"]
    url = health_url("etcd").replace("127.0.0.1:2379", f"127.0.0.1:{client}")
    log = open(tmp_path / "etcd.log", "wb")
    process = subprocess.Popen([str(etcd_binary()), *argv], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "etcd did not become healthy with the compose flags"
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


def test_the_jobs_service_finds_the_services_and_every_nodes_dra_socket() -> None:
    """`docker compose exec jobs cdsim job ...` is cdsim playing kubelet: its run.json names
    the services by their compose names and ports, and every node's DRA socket, CDI root and IMEX
    directories are in that node's state volume, mounted where the jobs container's layout looks
    for them (`cdsim check` reads them too)."""
    jobs = SERVICES[JOBS]
    assert "cdsim" in console_scripts() and "profiles" not in jobs  # `down -v` removes its volume
    assert jobs["depends_on"]["etcd"]["condition"] == "service_healthy"
    state_dir = jobs["environment"]["CDSIM_STATE_DIR"]
    layout = StateLayout.at(state_dir)
    [config] = jobs["configs"]
    assert config["target"] == str(layout.run_file)
    state = RunState.from_json(COMPOSE["configs"][config["source"]]["content"])
    assert state.phase == "ready" and state.tls_dir == ""
    assert state.etcd_endpoint == "etcd:2379"
    advisor = program("advisor").settings(environment("advisor"))
    assert state.advisor_endpoint == f"advisor:{advisor.grpc_port}"
    assert "cdnet" in jobs["networks"]  # the workload's imports dial each node's address
    mounts = dict(reversed(v.split(":")[:2]) for v in jobs["volumes"])
    assert mounts[state_dir] in COMPOSE["volumes"]  # jobs.json across runs
    plugins = programs_running(PLUGIN_TARGET)
    imex_agents = programs_running(IMEX_AGENT_TARGET)
    assert sorted(plugins) == sorted(simulated_cluster().node_names())
    for node, service in plugins.items():
        settings = program(service).settings(environment(service))
        dirs = layout.node(node)
        assert (Path(settings.kubelet_dir), Path(settings.cdi_root)) == (dirs.kubelet_dir, dirs.cdi_root)
        assert mounts[str(dirs.root)] == node_state_volume(service, settings)
        # The node record names the plugin's directories.
        recorded = program(imex_agents[node]).settings(environment(imex_agents[node]))
        assert (recorded.kubelet_dir, recorded.cdi_root) == (settings.kubelet_dir, settings.cdi_root)
        # And its IMEX daemons' directories, which `cdsim check` reads with the rest of the node.
        assert Path(recorded.imex_work_dir) == dirs.imex_dir
