"""Installing on clusters without resource.k8s.io/v1 (Kubernetes 1.32, 1.33): the kustomize component
manifests/components/resource-v1beta1 and the chart's resourceApiVersion change the DeviceClass's
apiVersion and nothing else. tests/k8s/test_kubernetes_versions.py applies them to a real 1.32."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.manifests.helm import HelmError, render
from tests.manifests.kustomize import build_kubectl, find_kubectl, object_id
from tests.manifests.objects import NAMESPACE, REPO_ROOT, Obj

COMPONENT = REPO_ROOT / "manifests" / "components" / "resource-v1beta1"
BASE = REPO_ROOT / "manifests" / "base"
DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"


def v1beta1_overlay(tmp_path: Path) -> Path:
    """An overlay of the base with the component, as a user writes it (kustomize wants relative paths)."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources:\n- {os.path.relpath(BASE, overlay)}\n"
        f"components:\n- {os.path.relpath(COMPONENT, overlay)}\n"
    )
    return overlay


def render_v1beta1_overlay(tmp_path: Path) -> list[Obj]:
    kubectl = find_kubectl()
    if kubectl is None:
        # Components are kustomize's, not the Python renderer's: `make setup-k8s` builds a kubectl.
        pytest.fail("no kubectl to render kustomize components (make setup-k8s builds one)", pytrace=False)
    return build_kubectl(v1beta1_overlay(tmp_path), kubectl)


def split_device_class(objects: list[Obj]) -> tuple[Obj, list[Obj]]:
    (device_class,) = [o for o in objects if o.get("kind") == "DeviceClass"]
    return device_class, [o for o in objects if o.get("kind") != "DeviceClass"]


def test_the_component_writes_the_device_class_as_v1beta1_and_changes_nothing_else(
    tmp_path: Path, base: list[Obj]
) -> None:
    old_class, old_rest = split_device_class(render_v1beta1_overlay(tmp_path))
    new_class, new_rest = split_device_class(base)
    assert new_class["apiVersion"] == "resource.k8s.io/v1"
    assert old_class["apiVersion"] == "resource.k8s.io/v1beta1"
    assert {k: v for k, v in old_class.items() if k != "apiVersion"} == {
        k: v for k, v in new_class.items() if k != "apiVersion"
    }
    assert sorted(map(object_id, old_rest)) == sorted(map(object_id, new_rest))
    assert old_rest == new_rest


def without_secrets(objects: list[Obj]) -> list[Obj]:
    # Each render makes new etcd certificates.
    return [o for o in objects if o["kind"] != "Secret"]


# NVIDIA's form (resource.k8s.io/<version>) and the short one.
@pytest.mark.parametrize("value", ["resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1", "v1beta1"])
def test_the_charts_resource_api_version_sets_the_device_class_only(
    helm: Path, tmp_path: Path, value: str
) -> None:
    default_class, default_rest = split_device_class(render(helm, NAMESPACE))
    chosen_class, chosen_rest = split_device_class(
        render(helm, NAMESPACE, {"resourceApiVersion": value}, tmp_path)
    )
    assert default_class["apiVersion"] == "resource.k8s.io/v1"  # helm template assumes a 1.34+ cluster
    assert chosen_class["apiVersion"] == f"resource.k8s.io/{value.rpartition('/')[2]}"
    assert chosen_class["spec"] == default_class["spec"]
    assert without_secrets(chosen_rest) == without_secrets(default_rest)


def test_the_chart_refuses_a_resource_api_version_it_cannot_write(helm: Path, tmp_path: Path) -> None:
    with pytest.raises(HelmError, match="at '/resourceApiVersion': value must be one of"):
        render(helm, NAMESPACE, {"resourceApiVersion": "resource.k8s.io/v1alpha3"}, tmp_path)
