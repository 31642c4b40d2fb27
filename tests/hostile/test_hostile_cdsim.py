"""Hostile input at the cdsim CLI, against a running cdsim cluster (one rack of 4 trays).

Names are checked as the API server would (a namespace is a DNS-1123 label, a job's ComputeDomain
name a DNS-1123 subdomain) and --nodes against the cluster's size. After each input: the cluster
is healthy (`cdsim check` passes), the refusal names the argument and the rule (exit 2 for a bad
name, 1 for --nodes beyond the cluster), and nothing is lost or added (the job submitted first is
the only one, still with all its imports). The CLI is run in-process (its `main`), which keeps
the many inputs fast; the cluster's services are real processes.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.kube.names import label_problem, subdomain_problem
from tests import address_blocks
from tests.cdsim.cli import cdsim, ok, status
from tools.cdsim.layout import StateLayout
from tools.cdsim.main import main
from tools.cdsim.proc_scan import cluster_processes

pytestmark = pytest.mark.slow

TRAYS = 4
JOB = "first"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-h"))
    try:
        ok(
            cdsim(
                state_dir,
                "up",
                "--racks",
                "1",
                "--trays",
                str(TRAYS),
                "--address-block",
                str(address_blocks.HOSTILE_CDSIM),
            )
        )
        ok(cdsim(state_dir, "job", "submit", JOB, "--nodes", "2", "--wait"))
        yield state_dir
    finally:
        cdsim(state_dir, "down", timeout=90)
        leftovers = cluster_processes(StateLayout.at(state_dir))
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leftovers, f"processes left running: {leftovers}"


def run(state_dir: Path, *args: str) -> tuple[int, str]:
    """`cdsim` in this process: (exit status, stdout and stderr together)."""
    out = io.StringIO()
    saved = structlog.get_config()  # main configures logging for the process; later tests capture logs
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(["--state-dir", str(state_dir), *args])
        except SystemExit as exc:
            code = int(exc.code or 0)
        finally:
            structlog.configure(**saved)
    return code, out.getvalue()


def still_fine(state_dir: Path) -> None:
    code, text = run(state_dir, "check")
    assert code == 0 and "invariants 1-4 hold" in text, text
    code, text = run(state_dir, "job", "check", JOB)
    assert code == 0, text
    jobs = status(state_dir)["jobs"]
    assert [(j["namespace"], j["name"]) for j in jobs] == [("default", JOB)], jobs


BAD_NAMES = ["UPPER", "a" * 300, "a/b", "", "-a", "a-", "a..b", "é", "a b", "a_b"]
BAD_NAMESPACES = ["Bad/NS", "a" * 64, "with.dot", "", "-x", "UP"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_job_name_is_refused_naming_the_rule(cluster: Path, name: str) -> None:
    code, text = run(cluster, "job", "submit", "--nodes", "1", "--", name)
    assert code == 2, text
    assert "argument name: job (ComputeDomain) name" in text and "DNS-1123 subdomain" in text, text
    assert len(text) < 2048
    still_fine(cluster)


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
def test_a_bad_namespace_is_refused_naming_the_rule(cluster: Path, namespace: str) -> None:
    for args in (("job", "submit", "ok", "--nodes", "1"), ("job", "delete", JOB)):
        code, text = run(cluster, *args, f"--namespace={namespace}")
        assert code == 2, text
        assert "argument -n/--namespace: namespace" in text and "DNS-1123 label" in text, text
    still_fine(cluster)


@pytest.mark.parametrize("nodes", [10000, TRAYS + 1, 0, -1])
def test_nodes_beyond_the_cluster_are_refused_naming_its_size(cluster: Path, nodes: int) -> None:
    code, text = run(cluster, "job", "submit", "big", "--nodes", str(nodes))
    assert code == 1, text
    if nodes > 0:
        assert f"--nodes {nodes}: the cluster has {TRAYS} nodes" in text, text
    else:
        assert "--nodes must be >= 1" in text, text
    still_fine(cluster)


@pytest.mark.parametrize("nodes", [10000, TRAYS + 1, 0])
def test_scaling_beyond_the_cluster_is_refused_naming_its_size_and_the_job_keeps_its_nodes(
    cluster: Path, nodes: int
) -> None:
    before = [j for j in status(cluster)["jobs"] if j["name"] == JOB]
    code, text = run(cluster, "job", "scale", JOB, "--nodes", str(nodes))
    assert code == 1, text
    if nodes > 0:
        assert f"--nodes {nodes}: the cluster has {TRAYS} nodes" in text, text
    else:
        assert "--nodes must be >= 1" in text, text
    assert [j for j in status(cluster)["jobs"] if j["name"] == JOB] == before
    still_fine(cluster)


def test_a_name_too_long_for_its_claims_is_refused(cluster: Path) -> None:
    name = "a" * 240  # a valid subdomain; "<name>-worker-1-channel" is not
    code, text = run(cluster, "job", "submit", name, "--nodes", "2")
    assert code == 1 and "too long for its claims' names" in text, text
    still_fine(cluster)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(max_size=70), namespace=st.text(max_size=70))
def test_any_names_are_taken_only_when_kubernetes_would(cluster: Path, name: str, namespace: str) -> None:
    valid = subdomain_problem(name) is None and label_problem(namespace) is None
    # --nodes beyond the cluster: a valid name gets as far as that check, and nothing is created.
    code, text = run(
        cluster, "job", "submit", f"--namespace={namespace}", "--nodes", str(TRAYS + 1), "--", name
    )
    if valid:
        assert code == 1 and f"the cluster has {TRAYS} nodes" in text, text
    else:
        assert code == 2 and "DNS-1123" in text, text
    code, text = run(cluster, "check")
    assert code == 0, text
