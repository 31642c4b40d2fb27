"""Installing into a namespace of one's own, on the real API server: the kustomize base moved by an
overlay's `namespace:` (with the NVIDIA driver root component), and the Helm chart rendered by the
real helm into a namespace made without our labels (as `helm install --create-namespace` makes
it). Each is applied whole; then the admission policies must still refuse, for the service accounts
of that namespace, what they refuse in compute-domains-system, as the accounts themselves
(impersonated, with the node a pod-bound token names)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from services.nodeagent.wire.resourceslice import build_resource_slice
from tests.manifests.helm import helm_binary, render
from tests.manifests.objects import MANIFESTS, Obj
from tests.polling import wait_until
from tools.cached_tool import BuildError
from tools.controlplane.cluster import ControlPlane

NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
CLIQUE = "9277d399-0674-44a9-b64e-d85bb19ce2b0.32766"
POLICY_WAIT_S = 60.0
# Cluster-scoped objects of ours that one install overwrites for the next; the CRD and the
# DeviceClass stay (the e2e tests apply the same ones).
OURS_CLUSTER_SCOPED = (
    "clusterrole/computedomains:controller",
    "clusterrole/computedomains:node-agent",
    "clusterrole/computedomains:placement-advisor",
    "clusterrolebinding/computedomains:controller",
    "clusterrolebinding/computedomains:node-agent",
    "clusterrolebinding/computedomains:placement-advisor",
    "validatingadmissionpolicy/computedomains-node-agent-resourceslices",
    "validatingadmissionpolicy/computedomains-node-labels",
    "validatingadmissionpolicybinding/computedomains-node-agent-resourceslices",
    "validatingadmissionpolicybinding/computedomains-node-labels",
)


def install_kustomize(cp: ControlPlane, work: Path, namespace: str) -> list[Obj]:
    overlay = work / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "namespace": namespace,
                "resources": [os.path.relpath(MANIFESTS / "base", overlay), "nvidia-driver-root.yaml"],
                "components": [os.path.relpath(MANIFESTS / "components" / "nvidia-driver-root", overlay)],
            }
        )
    )
    (overlay / "nvidia-driver-root.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": "cd-nvidia-driver-root",
                    "annotations": {"config.kubernetes.io/local-config": "true"},
                },
                "data": {"nvidiaDriverRoot": "/"},
            }
        )
    )
    rendered = cp.kubectl("kustomize", str(overlay)).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)
    return objects


def install_helm(cp: ControlPlane, work: Path, namespace: str) -> list[Obj]:
    try:
        helm = helm_binary()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    cp.kubectl("create", "namespace", namespace)  # no labels, as helm --create-namespace makes it
    objects = render(helm, namespace, {"nvidiaDriverRoot": "/"}, work)
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(objects))
    return objects


INSTALLERS: dict[str, Callable[[ControlPlane, Path, str], list[Obj]]] = {
    "kustomize": install_kustomize,
    "helm": install_helm,
}


class Install:
    def __init__(self, cp: ControlPlane, namespace: str, objects: list[Obj]) -> None:
        self.cp = cp
        self.namespace = namespace
        self.objects = objects
        suffix = namespace.rsplit("-", 1)[-1]
        self.mine, self.other = f"mine-{suffix}", f"other-{suffix}"

    def account(self, name: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{name}"

    def as_account(
        self, name: str, *args: str, node: str | None = None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        extra = [f"--as-user-extra={NODE_NAME_KEY}={node}"] if node else []
        return self.cp.kubectl(f"--as={self.account(name)}", *extra, *args, check=False, input=input)

    def create_slice(self, for_node: str) -> subprocess.CompletedProcess[str]:
        body = json.dumps(build_resource_slice(for_node, CLIQUE))
        return self.as_account("cd-node-agent", "create", "-o", "name", "-f", "-", node=self.mine, input=body)

    def label(self, account: str, node: str, key: str, value: str) -> subprocess.CompletedProcess[str]:
        patch = json.dumps({"metadata": {"labels": {key: value}}})
        return self.as_account(account, "patch", "node", node, "--type=merge", "-p", patch, node=self.mine)


@pytest.fixture(params=sorted(INSTALLERS))
def install(request: pytest.FixtureRequest, control_plane: ControlPlane, tmp_path: Path) -> Iterator[Install]:
    namespace = f"cd-{request.param}-{uuid.uuid4().hex[:6]}"
    cp = control_plane
    setup = Install(cp, namespace, [])
    for node in (setup.mine, setup.other):
        # A taint our DaemonSets do not tolerate: no pods are made for these kubelet-less Nodes.
        taint = {"key": "example.com/no-kubelet", "effect": "NoSchedule"}
        node_obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node},
            "spec": {"taints": [taint]},
        }
        cp.kubectl("create", "-f", "-", input=json.dumps(node_obj))
    try:
        setup.objects = INSTALLERS[request.param](cp, tmp_path, namespace)
        yield setup
    finally:
        for node in (setup.mine, setup.other):
            cp.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)
        cp.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)
        cp.kubectl("delete", "--ignore-not-found", "--wait=false", *OURS_CLUSTER_SCOPED, check=False)


def wait_for_policy(install: Install) -> subprocess.CompletedProcess[str]:
    """Another node's slice, until refused by the policy (RBAC and policies load asynchronously)."""
    last = ""

    def refused() -> subprocess.CompletedProcess[str] | None:
        nonlocal last
        proc = install.create_slice(install.other)
        if proc.returncode != 0 and "ValidatingAdmissionPolicy" in proc.stderr:
            return proc
        if proc.returncode == 0:  # not yet enforced: undo, try again
            install.cp.kubectl("delete", proc.stdout.strip())
        last = proc.stderr or proc.stdout
        return None

    return wait_until(
        refused,
        "the policy to refuse another node's slice",
        POLICY_WAIT_S,
        explain=lambda: f"last answer: {last}",
        first_delay_s=0.5,
    )


def test_nothing_names_the_default_namespace(install: Install) -> None:
    text = yaml.safe_dump_all(install.objects)
    # Only the etcd endpoint's default would, and it follows the namespace in the chart only.
    leftovers = [line.strip() for line in text.splitlines() if "compute-domains-system" in line]
    assert all("cd-etcd.compute-domains-system.svc" in line for line in leftovers), leftovers
    daemonsets = json.loads(
        install.cp.kubectl("get", "daemonsets", "-n", install.namespace, "-o", "json").stdout
    )
    assert {d["metadata"]["name"] for d in daemonsets["items"]} == {"cd-node-agent", "cd-imex-agent"}
    for daemonset in daemonsets["items"]:
        pod = daemonset["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["driver-root"]["hostPath"]["path"] == "/"
        assert pod["priorityClassName"] == "system-node-critical"


def test_policies_refuse_for_the_accounts_of_the_namespace(install: Install) -> None:
    refused = wait_for_policy(install)
    assert (
        "may only write ResourceSlices of driver compute-domain.nvidia.com for its own node" in refused.stderr
    )
    # Its own node's slice is allowed: RBAC follows the namespace too.
    own = install.create_slice(install.mine)
    assert own.returncode == 0, own.stderr
    install.cp.kubectl("delete", own.stdout.strip())
    # Nodes: the node agent only its own Node's clique label, the controller only the domain label.
    other_node = install.label("cd-node-agent", install.other, "nvidia.com/gpu.clique", CLIQUE)
    assert other_node.returncode != 0 and "may only change its own Node" in other_node.stderr
    wrong_label = install.label("cd-controller", install.other, "example.com/anything", "x")
    assert wrong_label.returncode != 0
    assert "may only change the Node label resource.nvidia.com/computeDomain" in wrong_label.stderr
    domain_label = install.label("cd-controller", install.other, "resource.nvidia.com/computeDomain", "uid-1")
    assert domain_label.returncode == 0, domain_label.stderr
