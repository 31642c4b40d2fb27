"""Simulated node hardware: node directories, and faults shared between processes via the file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from libs.hardware.clique import CliqueStatus
from libs.hardware.errors import HardwareError, ImexChannelsUnavailableError, UnknownNodeError
from libs.hardware.factory import open_node_hardware
from libs.hardware.imex_channels import imex_channel_container_path
from libs.hardware.interface import NodeHardware
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricState, GpuHealth
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.fault_file import NodeFaults
from tools.sim.hardware.simulated import (
    FAULTS_FILE_NAME,
    FaultInjector,
    SimulatedNodeHardware,
    default_state_base,
    host_character_driver,
    prepare_node_dirs,
)

NODE = "rack1-tray4"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster() -> ClusterDescription:
    return ClusterDescription(racks=2, partitions_per_rack=2, imex_channel_major=241)


@pytest.fixture
def state_base(tmp_path: Path, cluster: ClusterDescription) -> Path:
    base = tmp_path / "nodes"
    prepare_node_dirs(cluster, NODE, base)
    return base


def agent_view(cluster: ClusterDescription, state_base: Path) -> SimulatedNodeHardware:
    """The node agent's backend instance (separate from whoever injects faults)."""
    return SimulatedNodeHardware(cluster, NODE, state_base / NODE, poll_interval=0.01)


def test_healthy_node_reports_its_rack_clique(cluster: ClusterDescription, state_base: Path) -> None:
    hw = agent_view(cluster, state_base)
    assert isinstance(hw, NodeHardware) and hw.imex_backend == "simulated"
    node = cluster.node(NODE)
    result = hw.clique()
    assert (result.status, result.clique_id) == (CliqueStatus.FABRIC, node.clique)
    gpus = hw.gpus()
    assert [g.uuid for g in gpus] == [cluster.gpu_uuid(1, 4, i) for i in range(4)]
    assert hw.driver_version() == cluster.driver_version
    assert hw.snapshot().health is GpuHealth.HEALTHY


def test_node_dirs_give_proc_devices_with_the_cluster_major(
    cluster: ClusterDescription, state_base: Path
) -> None:
    hw = agent_view(cluster, state_base)
    assert hw.imex_channel_major() == 241
    assert "nvidia-caps-imex-channels" in (state_base / NODE / "proc" / "devices").read_text()
    assert hw.imex_channel_path(3) == state_base / NODE / "dev" / "nvidia-caps-imex-channels" / "channel3"
    assert imex_channel_container_path(3) == "/dev/nvidia-caps-imex-channels/channel3"


def test_missing_node_dirs_give_a_clear_channel_error(cluster: ClusterDescription, tmp_path: Path) -> None:
    hw = SimulatedNodeHardware(cluster, NODE, tmp_path / "never-prepared")
    with pytest.raises(ImexChannelsUnavailableError, match="cannot read"):
        hw.imex_channel_major()


def test_channel_device_stand_in_is_created_once(cluster: ClusterDescription, state_base: Path) -> None:
    hw = agent_view(cluster, state_base)
    path = hw.ensure_imex_channel_device(0)
    assert path == hw.imex_channel_path(0)
    assert path.read_text() == "c 241:0\n"
    assert path.stat().st_mode & 0o777 == 0o666
    assert hw.ensure_imex_channel_device(0) == path


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs CAP_MKNOD (root)")
def test_channel_is_a_real_device_node_when_the_cluster_asks_for_one(tmp_path: Path) -> None:
    """For a real container runtime: channel N is character device major:N, as the driver's would
    be, and the CDI spec's numbers; made once."""
    cluster = dataclasses.replace(
        ClusterDescription(racks=2, partitions_per_rack=2), imex_channel_device_nodes=True
    )
    assert host_character_driver(cluster.imex_channel_major) is None, (
        "the simulated major is a real driver's here"
    )
    prepare_node_dirs(cluster, NODE, tmp_path)
    hw = SimulatedNodeHardware.from_cluster_file(_saved(cluster, tmp_path), NODE, tmp_path)
    path = hw.ensure_imex_channel_device(3)
    st = path.stat()
    assert stat.S_ISCHR(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (cluster.imex_channel_major, 3)
    assert st.st_mode & 0o777 == 0o666
    assert hw.ensure_imex_channel_device(3) == path


def test_a_real_device_node_is_refused_for_a_major_a_host_driver_owns(tmp_path: Path) -> None:
    """Major 1 is the kernel's memory devices (1:1 is /dev/mem): never a simulated channel's node."""
    cluster = ClusterDescription(racks=1, imex_channel_major=1, imex_channel_device_nodes=True)
    prepare_node_dirs(cluster, "rack0-tray1", tmp_path)
    hw = SimulatedNodeHardware(cluster, "rack0-tray1", tmp_path / "rack0-tray1")
    with pytest.raises(HardwareError, match="major 1 is 'mem' on this host"):
        hw.ensure_imex_channel_device(1)
    assert not hw.imex_channel_path(1).exists()


def test_the_device_node_choice_round_trips_and_is_a_boolean(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=1, imex_channel_device_nodes=True)
    assert ClusterDescription.from_json(cluster.to_json()) == cluster
    data = json.loads(cluster.to_json())
    data["imex_channel_device_nodes"] = 1
    with pytest.raises(ValueError, match="'imex_channel_device_nodes' must be bool"):
        ClusterDescription.from_json(json.dumps(data))


def _saved(cluster: ClusterDescription, directory: Path) -> Path:
    path = directory / "cluster.json"
    cluster.save(path)
    return path


def test_fault_set_by_one_instance_is_seen_by_another(cluster: ClusterDescription, state_base: Path) -> None:
    cdsim = FaultInjector(state_base / NODE / FAULTS_FILE_NAME, cluster.gpus_per_tray)
    agent = agent_view(cluster, state_base)

    cdsim.set_fabric_state(FabricState.IN_PROGRESS, gpu=2)
    result = agent.clique()
    assert result.status is CliqueStatus.PENDING and "GPU 2" in result.reason
    gpu2 = agent.gpus()[2]
    assert gpu2.fabric.cluster_uuid == ZERO_CLUSTER_UUID  # not assigned until COMPLETED

    cdsim.set_fabric_state(None, gpu=2)
    assert agent.clique().clique_id == cluster.node(NODE).clique

    cdsim.set_fabric_state(FabricState.NOT_STARTED)
    assert all(g.fabric.state is FabricState.NOT_STARTED for g in agent.gpus())

    cdsim.clear()
    assert agent.clique().status is CliqueStatus.FABRIC
    assert not (state_base / NODE / FAULTS_FILE_NAME).read_text().count("NOT_STARTED")


def test_non_fabric_and_disagreeing_gpu_faults(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    agent.faults.set_non_fabric()
    result = agent.clique()
    assert (result.status, result.clique_id) == (CliqueStatus.NON_FABRIC, "")

    agent.faults.set_non_fabric(False)
    agent.faults.set_clique_id(3, 4242)
    result = agent.clique()
    assert result.status is CliqueStatus.ERROR
    assert cluster.node(NODE).clique in result.reason
    assert f"{cluster.node(NODE).cluster_uuid}.4242" in result.reason


def test_degraded_health_on_one_gpu_and_node_wide(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    agent.faults.set_health(GpuHealth.DEGRADED, gpu=1)
    assert [g.health for g in agent.gpus()] == [GpuHealth.HEALTHY, GpuHealth.DEGRADED] + [
        GpuHealth.HEALTHY
    ] * 2
    agent.faults.set_health(GpuHealth.UNHEALTHY)
    # the GPU's own fault wins over the node-wide one
    assert [g.health for g in agent.gpus()] == [GpuHealth.UNHEALTHY, GpuHealth.DEGRADED] + [
        GpuHealth.UNHEALTHY
    ] * 2
    assert agent.snapshot().health is GpuHealth.UNHEALTHY
    assert agent.clique().status is CliqueStatus.FABRIC  # health does not change the clique


def test_fault_from_another_process_is_seen(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    assert agent.clique().status is CliqueStatus.FABRIC
    script = (
        "import sys; from pathlib import Path;"
        "from tools.sim.hardware.simulated import FaultInjector;"
        "from libs.hardware.model import FabricState;"
        "FaultInjector(Path(sys.argv[1]), 4).set_fabric_state(FabricState.IN_PROGRESS, gpu=0)"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(state_base / NODE / FAULTS_FILE_NAME)],
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=60,
    )
    assert agent.clique().status is CliqueStatus.PENDING


async def test_injected_fault_produces_a_health_event(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    before = agent.snapshot()
    events = agent.health_events(since=before)
    agent.faults.set_health(GpuHealth.DEGRADED, gpu=1)  # lands before the first poll: not missed
    async with asyncio.timeout(5):
        event = await anext(events)
    assert event.error == ""
    assert event.snapshot.health is GpuHealth.DEGRADED
    assert any("(GPU 1): health Healthy -> Degraded" in line for line in event.changes)

    agent.faults.set_fabric_state(FabricState.IN_PROGRESS)
    async with asyncio.timeout(5):
        event = await anext(events)
    assert event.snapshot.clique.status is CliqueStatus.PENDING
    assert any("fabric state COMPLETED -> IN_PROGRESS" in line for line in event.changes)
    assert any(line.startswith("clique Fabric") for line in event.changes)
    await events.aclose()


async def test_no_event_without_a_change(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    events = agent.health_events()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await anext(events)


def test_broken_fault_file_keeps_the_last_good_faults(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    agent.faults.set_fabric_state(FabricState.IN_PROGRESS, gpu=0)
    assert agent.clique().status is CliqueStatus.PENDING
    (state_base / NODE / FAULTS_FILE_NAME).write_text('{"version": 1, "fabric_state": "ON_FIRE"')
    assert agent.clique().status is CliqueStatus.PENDING  # no crash, last good view
    with pytest.raises(ValueError, match="not JSON"):
        agent.faults.set_health(GpuHealth.DEGRADED)  # writers refuse to build on garbage


def test_fault_file_decoding_is_strict() -> None:
    with pytest.raises(ValueError, match="ON_FIRE"):
        NodeFaults.from_json(json.dumps({"version": 1, "fabric_state": "ON_FIRE"}))
    with pytest.raises(ValueError, match="unknown field"):
        NodeFaults.from_json(json.dumps({"version": 1, "gpus": {"0": {"temperature": 90}}}))
    faults = NodeFaults(health=GpuHealth.DEGRADED).with_gpu(
        2, fabric_state=FabricState.NOT_STARTED, clique_id=9
    )
    assert NodeFaults.from_json(faults.to_json()) == faults


def test_prepare_keeps_injected_faults(cluster: ClusterDescription, state_base: Path) -> None:
    agent = agent_view(cluster, state_base)
    agent.faults.set_non_fabric()
    prepare_node_dirs(cluster, NODE, state_base)
    assert agent.clique().status is CliqueStatus.NON_FABRIC


def test_fault_on_a_gpu_the_node_lacks_is_refused(cluster: ClusterDescription, state_base: Path) -> None:
    with pytest.raises(ValueError, match="GPU 4 out of range"):
        agent_view(cluster, state_base).faults.set_health(GpuHealth.DEGRADED, gpu=4)


def test_factory_opens_a_node_from_the_cluster_file(cluster: ClusterDescription, tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    cluster.save(cluster_file)
    prepare_node_dirs(cluster, NODE, default_state_base(cluster_file))
    hw = open_node_hardware("simulated", sim_cluster=cluster_file, node=NODE)
    assert hw.imex_backend == "simulated"
    assert hw.clique().clique_id == cluster.node(NODE).clique
    assert hw.imex_channel_major() == 241
    with pytest.raises(UnknownNodeError):
        open_node_hardware("simulated", sim_cluster=cluster_file, node="rack9-tray0")
    with pytest.raises(ValueError, match="unknown hardware backend"):
        open_node_hardware("tpu")
    with pytest.raises(ValueError, match="needs a cluster description"):
        open_node_hardware("simulated", node=NODE)
