"""The pure parts of `cdsim up --kubernetes`: service flags, the extender entry, the CLI options, the
inotify budget that bounds the kubelets. The whole thing runs in tests/cdsim/test_kubernetes_mode.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.cdsim.cli import cdsim
from tools.cdsim import proc_scan
from tools.cdsim.kube_plane import DEFAULT_TRAYS, extender_config, kubernetes_specs, set_flag
from tools.cdsim.layout import StateLayout
from tools.cdsim.main import build_parser
from tools.cdsim.run_state import SimConfig
from tools.cdsim.services import Ports, all_specs
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.kubelet.inotify import (
    INSTANCES_PER_CONTROL_PLANE,
    INSTANCES_PER_KUBELET,
    InotifyBudget,
    InotifyBudgetExceeded,
)


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


def test_services_run_in_kubernetes_mode(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=1, trays_per_rack=2)
    layout = StateLayout.at(tmp_path)
    config = SimConfig(racks=1, trays_per_rack=2, kubernetes=True)
    ports = Ports(etcd=1, advisor_grpc=2, advisor_health=3, controller_health=(4, 5))
    kubeconfig = tmp_path / "kube" / "admin.kubeconfig"
    specs = kubernetes_specs(
        all_specs(cluster, layout, config, ports), kubeconfig=kubeconfig, extender_port=4242
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
    # Kubelets are not supervised services: they run beside the control plane (KubeMode).
    assert {s.kind for s in specs} == {"agent", "imex-agent", "controller", "advisor"}


def test_extender_points_at_the_advisor_and_is_not_ignorable() -> None:
    entry = extender_config(8123)
    assert entry["urlPrefix"] == "http://127.0.0.1:8123/"
    assert (entry["filterVerb"], entry["prioritizeVerb"]) == ("filter", "prioritize")
    assert entry["ignorable"] is False


def test_up_takes_kubernetes_and_the_process_scan_knows_the_control_plane() -> None:
    args = build_parser().parse_args(["up", "--kubernetes", "--racks", "2"])
    assert args.kubernetes is True and args.racks == 2
    assert build_parser().parse_args(["up"]).kubernetes is False
    assert {"kube-apiserver", "kube-scheduler", "kube-controller-manager"} <= set(proc_scan.KUBE_MARKERS)
    assert {"/kubelet", "/crisim"} <= set(proc_scan.KUBE_MARKERS)


def test_kubernetes_mode_defaults_to_the_trays_that_fit_and_simulation_keeps_a_full_rack() -> None:
    assert build_parser().parse_args(["up", "--kubernetes"]).trays is None  # DEFAULT_TRAYS then
    assert DEFAULT_TRAYS == 8
    # 8 kubelets and a control plane fit the kernel's default 128 instances with half to spare.
    assert InotifyBudget(limit=128, in_use=0).kubelets_that_fit(control_planes=1) >= DEFAULT_TRAYS
    assert DEFAULT_TRAYS * INSTANCES_PER_KUBELET + INSTANCES_PER_CONTROL_PLANE <= 128 // 2


def test_the_inotify_budget_counts_kubelets_control_planes_and_headroom() -> None:
    budget = InotifyBudget(limit=128, in_use=40)
    # (128 - 40 - 13 - 8) // 4
    assert budget.kubelets_that_fit(control_planes=1) == 16
    budget.require(16, control_planes=1)
    with pytest.raises(InotifyBudgetExceeded) as refused:
        budget.require(17, control_planes=1)
    message = str(refused.value)
    for part in ("fs.inotify.max_user_instances is 128", "hold 40", "each kubelet takes 4", "at most 16"):
        assert part in message, message
    assert InotifyBudget(limit=128, in_use=130).kubelets_that_fit() == 0


def test_up_refuses_more_kubernetes_nodes_than_the_inotify_budget_before_starting_anything() -> None:
    # 10 racks x 18 trays = 180 kubelets = 720 instances: more than any default limit allows.
    with tempfile.TemporaryDirectory(prefix="cdk-") as state_dir:  # short: unix socket paths
        result = cdsim(Path(state_dir), "up", "--kubernetes", "--racks", "10", "--trays", "18")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "cannot run 180 nodes with Kubernetes" in result.stderr
        assert "fs.inotify.max_user_instances" in result.stderr
        assert not (Path(state_dir) / "logs").exists(), "nothing may be started"
