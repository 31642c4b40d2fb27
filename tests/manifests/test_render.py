"""The kustomize trees render, to well-formed objects, the same with kubectl and our renderer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.manifests.kustomize import (
    KustomizeError,
    apply_json6902,
    build_python,
    find_kubectl,
    object_id,
    split_image,
    strategic_merge,
)
from tests.manifests.objects import IMAGE, NAMESPACE, TREES, Obj

CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}

KUBECTL = find_kubectl()


if KUBECTL is not None:
    # Only where a kubectl exists (`rendered` then comes from `kubectl kustomize`); elsewhere the
    # Python renderer is all there is, and an empty parametrization would report a skip.

    @pytest.mark.parametrize("name", sorted(TREES))
    def test_python_renderer_agrees_with_kubectl_kustomize(name: str, rendered: dict[str, list[Obj]]) -> None:
        assert build_python(TREES[name]) == rendered[name]


def test_every_object_is_identified_and_placed(tree: tuple[str, list[Obj]]) -> None:
    name, objects = tree
    assert objects, f"{name} rendered nothing"
    ids = [object_id(o) for o in objects]
    assert len(ids) == len(set(ids)), f"{name}: duplicate objects"
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{obj['kind']} {obj['metadata']['name']} is cluster-scoped"
        else:
            assert namespace == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']} in {namespace!r}"


def test_namespace_comes_first_so_apply_creates_it_before_its_objects(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    assert objects[0]["kind"] == "Namespace" and objects[0]["metadata"]["name"] == NAMESPACE


def test_our_containers_run_the_image_set_by_kustomize(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    ours = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert {o["metadata"]["name"] for o in ours} == {
        "cd-controller",
        "cd-placement-advisor",
        "cd-node-agent",
        "cd-imex-agent",
    }
    for workload in ours:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == IMAGE, f"{workload['metadata']['name']}/{c['name']}: {c['image']}"


# --- the Python renderer on its own ----------------------------------------------------------


def _write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app, namespace: ns}
spec:
  template:
    spec:
      containers:
      - name: main
        image: app:1
        args: [--a=1]
        env: [{name: A, value: "1"}, {name: B, value: "2"}]
"""


def test_strategic_patch_merges_containers_and_env_by_name(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "deploy.yaml": DEPLOYMENT,
            "patch.yaml": (
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app, namespace: ns}\n"
                "spec:\n  template:\n    spec:\n      containers:\n      - name: main\n"
                "        env: [{name: B, value: changed}, {name: C, value: '3'}]\n"
            ),
            "kustomization.yaml": "resources: [deploy.yaml]\npatches:\n- path: patch.yaml\n",
        },
    )
    [deploy] = build_python(tmp_path)
    [main] = deploy["spec"]["template"]["spec"]["containers"]
    assert main["image"] == "app:1" and main["args"] == ["--a=1"]
    assert {e["name"]: e["value"] for e in main["env"]} == {"A": "1", "B": "changed", "C": "3"}


def test_json6902_patch_appends_flags_to_the_target_only(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "deploy.yaml": DEPLOYMENT + "---\n" + DEPLOYMENT.replace("name: app,", "name: other,"),
            "flags.yaml": "- {op: add, path: /spec/template/spec/containers/0/args/-, value: --b=2}\n",
            "kustomization.yaml": (
                "resources: [deploy.yaml]\npatches:\n- path: flags.yaml\n"
                "  target: {kind: Deployment, name: app}\n"
            ),
        },
    )
    by_name = {o["metadata"]["name"]: o for o in build_python(tmp_path)}
    assert by_name["app"]["spec"]["template"]["spec"]["containers"][0]["args"] == ["--a=1", "--b=2"]
    assert by_name["other"]["spec"]["template"]["spec"]["containers"][0]["args"] == ["--a=1"]


def test_images_replace_name_and_tag(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "deploy.yaml": DEPLOYMENT,
            "kustomization.yaml": "resources: [deploy.yaml]\nimages:\n- {name: app, newName: reg:5000/x/app, newTag: v2}\n",
        },
    )
    [deploy] = build_python(tmp_path)
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "reg:5000/x/app:v2"
    assert split_image("reg:5000/x/app:v2") == ("reg:5000/x/app", "v2", "")
    assert split_image("reg:5000/x/app") == ("reg:5000/x/app", "", "")


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [deploy.yaml]\nnamePrefix: x-\n",  # a feature the renderer does not have
        "resources: [missing.yaml]\n",
        "resources: [deploy.yaml]\npatches:\n- patch: '[{op: add, path: /x, value: 1}]'\n",  # no target
        "resources: [deploy.yaml]\npatches:\n- path: nothing.yaml\n",  # patch for an absent object
    ],
)
def test_renderer_refuses_what_it_cannot_render_faithfully(tmp_path: Path, kustomization: str) -> None:
    _write(
        tmp_path,
        {
            "deploy.yaml": DEPLOYMENT,
            "nothing.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: absent, namespace: ns}\n",
            "kustomization.yaml": kustomization,
        },
    )
    with pytest.raises(KustomizeError):
        build_python(tmp_path)


def test_json6902_operations() -> None:
    doc = {"a": {"list": [1, 2]}, "b": 1}
    patched = apply_json6902(
        doc,
        [
            {"op": "add", "path": "/a/list/0", "value": 0},
            {"op": "replace", "path": "/b", "value": 2},
            {"op": "remove", "path": "/a/list/2"},
            {"op": "test", "path": "/a/list", "value": [0, 1]},
        ],
    )
    assert patched == {"a": {"list": [0, 1]}, "b": 2}
    assert doc == {"a": {"list": [1, 2]}, "b": 1}, "the input must not change"
    with pytest.raises(KustomizeError):
        apply_json6902(doc, [{"op": "replace", "path": "/missing", "value": 1}])
    with pytest.raises(KustomizeError):
        apply_json6902(doc, [{"op": "test", "path": "/b", "value": 5}])


def test_strategic_merge_null_deletes_and_plain_lists_are_replaced() -> None:
    original = yaml.safe_load("spec: {keep: 1, drop: 2, args: [a, b]}")
    merged = strategic_merge(original, {"spec": {"drop": None, "args": ["c"]}})
    assert merged == {"spec": {"keep": 1, "args": ["c"]}}
