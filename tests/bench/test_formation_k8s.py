"""The Kubernetes formation benchmark end to end, at a small size: a real control plane, the kubelet
shim and scale-mode node agents in Kubernetes mode form a domain from an Indexed Job, and the audit
log attributes every write to its component."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = 3


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_job_forms_its_domain_on_kubernetes_and_our_writes_are_counted(tmp_path: Path) -> None:
    out = tmp_path / "formation_k8s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.formation_k8s", "--nodes", str(NODES), "--racks", "1", "--reps", "1",
         "--timeout-s", "240", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    formation = result["formation"]["formations"][0]
    # Every pod Running (its claim prepared by our node agent) and the domain Ready.
    assert 0 < formation["scheduled_s"] <= formation["prepared_s"] <= formation["formation_s"]
    assert formation["ready_s"] <= formation["formation_s"]
    # Kubernetes' floor, the same Job without a domain, ran before it on the same nodes.
    plain = formation["plain_job"]
    assert 0 < plain["scheduled_s"] <= plain["running_s"] and 1 <= plain["nodes_used"] <= NODES
    summary = result["formation"]
    assert summary["plain_job_p50_s"] == pytest.approx(plain["running_s"], abs=1e-3)
    assert summary["ratio_to_plain_job"] == pytest.approx(
        summary["formation_p50_s"] / summary["plain_job_p50_s"], rel=1e-2
    )
    writes = formation["writes"]
    kinds = writes["ours_by_kind"]
    # The controller labels each member Node once and makes the domain's claim template once; the
    # node agents only read claims while a domain forms (their slices were published at start).
    assert kinds["cd-controller patch nodes"] == NODES
    assert kinds["cd-controller create resourceclaimtemplates"] == 1
    assert not any(kind.startswith("cd-node-agent") for kind in kinds)
    assert writes["ours"] == sum(kinds.values()) and writes["ours_per_node"] == pytest.approx(
        writes["ours"] / NODES, abs=1e-3
    )  # rounded to 3 places
    # Kubernetes' own components and the shim are counted apart from ours.
    assert writes["by_component"]["kube-scheduler"] > 0 and writes["by_component"]["kubelet shim"] > 0
    settings = result["settings"]
    assert settings["kube_etcd_fsync"] is True and settings["etcd_fsync"] is True
    assert settings["scheduler_percentage_of_nodes_to_score"] == 100
    assert str(REPO) not in out.read_text()
