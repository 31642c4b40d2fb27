"""`helm install` of deployments/helm/compute-domains against a real API server of the oldest and
the newest supported Kubernetes (1.32 and 1.37), each a control plane of this module's own (the
release's cluster-scoped objects would otherwise clash with what other modules apply).

On each: every object of the release exists, the DeviceClass in the resource.k8s.io version that
release serves; `helm uninstall` keeps the CRD. On the newest: a ComputeDomain CRD left by another
installer (NVIDIA's chart installs its CRD from crds/, owned by no release) is refused by
`helm install` and taken over with `--take-ownership --force-conflicts`; an older chart's CRD,
without a status field, is upgraded by `helm upgrade` (Helm never upgrades crds/, so the chart
templates it); an upgrade keeps the chart's etcd certificates until they are due, then reissues
them from the same CA and rolls the pods.

The etcd roles Job is a post-install hook that needs a kubelet to finish, which these control
planes lack: it is installed with --no-hooks here and its command is run against the chart's
etcd in tests/manifests/test_helm_services.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.manifests.helm import CHART, HELM_TIMEOUT_S
from tools.cached_tool import BuildError
from tools.controlplane.binaries import ensure_binaries, supported_minors
from tools.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.timeout(300)

CRD = "computedomains.resource.nvidia.com"
RELEASE = "cd"
# The oldest and the newest release the chart supports (Chart.yaml's kubeVersion).
MINORS = (supported_minors()[-1], supported_minors()[0])


@pytest.fixture(scope="module", params=MINORS)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    try:
        binaries = ensure_binaries(minor=request.param)
    except BuildError as exc:
        pytest.fail(f"building the Kubernetes {request.param} control plane failed:\n{exc}", pytrace=False)
    cp = ControlPlane(binaries, tmp_path_factory.mktemp(f"helm-{request.param}"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def run_helm(helm: Path, cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), "--kubeconfig", str(cp.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=HELM_TIMEOUT_S * 3,
        check=False,
    )


def older_chart(work: Path) -> Path:
    """The chart as an older release of it: its CRD without status.imexMesh."""
    chart = work / "compute-domains-old"
    shutil.copytree(CHART, chart)  # the files/ links become files
    crd_file = chart / "files" / "crd-computedomains.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    for version in crd["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["imexMesh"]
    crd_file.write_text(yaml.safe_dump(crd))
    return chart


def live_status_fields(cp: ControlPlane) -> set[str]:
    crd = json.loads(cp.kubectl("get", "crd", CRD, "-o", "json").stdout)
    [version] = [v for v in crd["spec"]["versions"] if v["storage"]]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"])


def secret_data(cp: ControlPlane, namespace: str) -> dict[str, dict[str, str]]:
    """The chart's etcd certificate Secrets: name -> data."""
    secrets = json.loads(cp.kubectl("get", "secrets", "-n", namespace, "-o", "json").stdout)["items"]
    return {s["metadata"]["name"]: s["data"] for s in secrets if s["metadata"]["name"].startswith("cd-etcd-")}


def install_args(namespace: str) -> tuple[str, ...]:
    return ("install", RELEASE, "-n", namespace, "--create-namespace", "--no-hooks", "--timeout", "120s")


def test_install_creates_every_object_and_uninstall_keeps_the_crd(cluster: ControlPlane, helm: Path) -> None:
    cp = cluster
    namespace = f"cd-helm-{uuid.uuid4().hex[:6]}"
    installed = run_helm(helm, cp, *install_args(namespace), str(CHART))
    assert installed.returncode == 0, installed.stderr

    # Every object of the release exists (kubectl get fails naming any that does not).
    manifest = run_helm(helm, cp, "get", "manifest", RELEASE, "-n", namespace).stdout
    objects = [o for o in yaml.safe_load_all(manifest) if o]
    live = json.loads(cp.kubectl("get", "-o", "json", "-f", "-", input=manifest).stdout)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in live["items"]) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in objects
    )
    kinds = {o["kind"] for o in objects}
    assert {
        "StatefulSet",
        "Secret",
        "Deployment",
        "DaemonSet",
        "CustomResourceDefinition",
        "DeviceClass",
    } <= kinds
    served = cp.kubectl("api-versions").stdout.split()
    [device_class] = [o for o in objects if o["kind"] == "DeviceClass"]
    newest_served = next(v for v in ("v1", "v1beta2", "v1beta1") if f"resource.k8s.io/{v}" in served)
    assert device_class["apiVersion"] == f"resource.k8s.io/{newest_served}"
    hooks = run_helm(helm, cp, "get", "hooks", RELEASE, "-n", namespace).stdout
    assert [o["metadata"]["name"] for o in yaml.safe_load_all(hooks) if o] == ["cd-etcd-roles"]

    uninstalled = run_helm(helm, cp, "uninstall", RELEASE, "-n", namespace, "--no-hooks")
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert cp.kubectl("get", "crd", CRD, check=False).returncode == 0  # kept: it holds the domains
    assert cp.kubectl("get", "clusterrole", "computedomains:controller", check=False).returncode != 0


# The CRD's and the certificates' life needs one release only: the newest.
@pytest.mark.parametrize("cluster", [MINORS[-1]], indirect=True)
def test_a_left_crd_is_taken_over_upgraded_and_certificates_renewed(
    cluster: ControlPlane, helm: Path, tmp_path: Path
) -> None:
    cp = cluster
    namespace = f"cd-helm-{uuid.uuid4().hex[:6]}"
    old = older_chart(tmp_path)
    # A CRD another installer left, not the same as ours (NVIDIA's lacks our status fields).
    leftover = yaml.safe_load((old / "files" / "crd-computedomains.yaml").read_text())
    for version in leftover["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"]["properties"]["status"]["description"] = "another installer's"
    leftover["metadata"]["labels"] = leftover["metadata"]["annotations"] = None  # owned by no release
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(leftover))

    refused = run_helm(helm, cp, *install_args(namespace), str(old))
    assert refused.returncode != 0
    assert CRD in refused.stderr and "ownership" in refused.stderr, refused.stderr

    # Helm 4 applies server-side: the other installer's field manager owns the CRD's versions (an
    # atomic list), so taking it over takes --force-conflicts as well; else the install conflicts
    # and, once the values agree, every later upgrade that changes the CRD would.
    taken = run_helm(helm, cp, *install_args(namespace), "--take-ownership", "--force-conflicts", str(old))
    assert taken.returncode == 0, taken.stderr
    assert "imexMesh" not in live_status_fields(cp)

    certificates = secret_data(cp, namespace)
    upgrade = ("upgrade", RELEASE, str(CHART), "-n", namespace, "--no-hooks", "--timeout", "120s")
    upgraded = run_helm(helm, cp, *upgrade)
    assert upgraded.returncode == 0, upgraded.stderr
    assert {"imexMesh", "nodeCount", "conditions", "nodes"} <= live_status_fields(cp)
    # An upgrade keeps the certificates (read back with lookup) while they are not due.
    assert secret_data(cp, namespace) == certificates

    # Due (fewer than renewBeforeDays left): reissued from the same CA, and the pods roll.
    renew = ("--set", "etcd.certificates.validityDays=400", "--set", "etcd.certificates.renewBeforeDays=399")
    renewed = run_helm(helm, cp, *upgrade, *renew)
    assert renewed.returncode == 0, renewed.stderr
    reissued = secret_data(cp, namespace)
    assert reissued["cd-etcd-ca"] == certificates["cd-etcd-ca"]
    for name in set(certificates) - {"cd-etcd-ca"}:
        assert reissued[name]["tls.crt"] != certificates[name]["tls.crt"], name
        assert reissued[name]["ca.crt"] == certificates["cd-etcd-ca"]["ca.crt"], name
    controller = json.loads(
        cp.kubectl("get", "deployment", "cd-controller", "-n", namespace, "-o", "json").stdout
    )
    expiry = controller["spec"]["template"]["metadata"]["annotations"][
        "computedomains.nvidia.com/etcd-certs-expiry-day"
    ]
    assert int(expiry) == int(time.time() // 86400) + 400
    assert run_helm(helm, cp, "uninstall", RELEASE, "-n", namespace, "--no-hooks").returncode == 0
