"""The pure parts of `cdsim up --kubernetes`: service flags, the shim's nodes and health flags, the
extender entry, the CLI option. The whole thing runs in tests/cdsim/test_kubernetes_mode.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libs.hardware.cluster import ClusterDescription
from tools.cdsim import procscan
from tools.cdsim.kubeplane import SHIM_KIND, extender_config, kubernetes_specs, set_flag, shim_nodes_document
from tools.cdsim.layout import StateLayout
from tools.cdsim.main import build_parser
from tools.cdsim.runstate import SimConfig
from tools.cdsim.services import Ports, all_specs
from tools.kubeletshim.nodes import parse_nodes
from tools.kubeletshim.service import UsageError, split_health_flags


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_set_flag_replaces_a_value_or_appends_the_flag() -> None:
    assert set_flag(["--mode", "simulation", "--x", "1"], "--mode", "kubernetes") == [
        "--mode",
        "kubernetes",
        "--x",
        "1",
    ]
    assert set_flag(["--x", "1"], "--kubeconfig", "k") == ["--x", "1", "--kubeconfig", "k"]


def test_services_run_in_kubernetes_mode_and_the_shim_is_added(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=1, trays_per_rack=2)
    layout = StateLayout.at(tmp_path)
    config = SimConfig(racks=1, trays_per_rack=2, kubernetes=True)
    ports = Ports(etcd=1, advisor_grpc=2, advisor_health=3, controller_health=(4, 5))
    kubeconfig = tmp_path / "kube" / "admin.kubeconfig"
    specs = kubernetes_specs(
        all_specs(cluster, layout, config, ports),
        layout=layout,
        config=config,
        kubeconfig=kubeconfig,
        extender_port=4242,
        shim_health_port=4343,
        nodes_file=tmp_path / "nodes.json",
    )
    by_kind: dict[str, list[list[str]]] = {}
    for spec in specs:
        by_kind.setdefault(spec.kind, []).append(spec.argv)
    for argv in by_kind["agent"]:
        assert _value(argv, "--claim-source") == "kubernetes"
        assert _value(argv, "--kubeconfig") == str(kubeconfig)
        assert _value(argv, "--publish-clique-label") == "true"
    assert len(by_kind["controller"]) == 2
    for argv in by_kind["controller"]:
        assert _value(argv, "--mode") == "kubernetes"
        assert _value(argv, "--kubeconfig") == str(kubeconfig)
    (advisor,) = by_kind["advisor"]
    assert _value(advisor, "--extender-enabled") == "true"
    assert _value(advisor, "--extender-port") == "4242"
    assert _value(advisor, "--template-source") == "kubernetes"
    # The advisor's default TTL: it releases a domain's reservations once they served.
    assert "--extender-reservation-ttl-s" not in advisor
    # The IMEX agents do not talk to Kubernetes: unchanged.
    for argv in by_kind["imex-agent"]:
        assert "--kubeconfig" not in argv
    (shim,) = [s for s in specs if s.kind == SHIM_KIND]
    assert shim.health_url == "http://127.0.0.1:4343/healthz"
    assert _value(shim.argv, "--nodes-file") == str(tmp_path / "nodes.json")


def test_shim_nodes_carry_clique_labels_kubelet_dirs_and_four_gpus(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=2, trays_per_rack=3)
    layout = StateLayout.at(tmp_path)
    nodes = parse_nodes(json.loads(json.dumps(shim_nodes_document(cluster, layout))))
    assert [n.name for n in nodes] == list(cluster.node_names())
    cliques = {n.labels["nvidia.com/gpu.clique"] for n in nodes}
    assert len(cliques) == 2  # one per rack
    for node in nodes:
        assert node.kubelet_dir == layout.node(node.name).kubelet_dir
        assert node.capacity["nvidia.com/gpu"] == "4"
        assert node.address == cluster.node(node.name).address


def test_extender_points_at_the_advisor_and_is_not_ignorable() -> None:
    entry = extender_config(8123)
    assert entry["urlPrefix"] == "http://127.0.0.1:8123/"
    assert (entry["filterVerb"], entry["prioritizeVerb"]) == ("filter", "prioritize")
    assert entry["ignorable"] is False


def test_shim_service_takes_its_health_flags_and_passes_the_rest() -> None:
    host, port, rest = split_health_flags(
        ["--kubeconfig", "k", "--health-port", "9000", "--health-host=127.0.0.2", "--nodes-file", "n"]
    )
    assert (host, port, rest) == ("127.0.0.2", 9000, ["--kubeconfig", "k", "--nodes-file", "n"])
    with pytest.raises(UsageError, match="--health-port is required"):
        split_health_flags(["--kubeconfig", "k"])
    with pytest.raises(UsageError, match="port number, got 'x'"):
        split_health_flags(["--health-port", "x"])
    with pytest.raises(UsageError, match="needs a value"):
        split_health_flags(["--health-port"])


def test_shim_service_refuses_a_missing_health_port_by_name() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.kubeletshim.service", "--kubeconfig", "k"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--health-port is required" in proc.stderr


def test_up_takes_kubernetes_and_the_process_scan_knows_the_control_plane() -> None:
    args = build_parser().parse_args(["up", "--kubernetes", "--racks", "2"])
    assert args.kubernetes is True and args.racks == 2
    assert build_parser().parse_args(["up"]).kubernetes is False
    assert {"kube-apiserver", "kube-scheduler", "kube-controller-manager"} <= set(procscan.KUBE_MARKERS)
