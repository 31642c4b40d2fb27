"""Render the kustomize trees under manifests/ into a list of objects.

`build(path)` uses `kubectl kustomize` when a kubectl is found (on PATH, or the one the control-plane
build put in the cache), else `build_python(path)`: a small renderer for the kustomize features
manifests/ uses, so the manifest tests run everywhere. It fails loudly on anything else, so a
manifest that starts using another feature cannot be rendered wrongly in silence:

* ``resources``: YAML files (several documents each) and directories holding a kustomization;
* ``patches``: strategic-merge patches (``path`` or inline ``patch``, matched by kind, name and
  namespace, or by ``target``) and JSON 6902 patches (a list of operations, with ``target``);
* ``images``: ``name`` -> ``newName`` / ``newTag`` / ``digest`` on pod template containers.

Output order is kustomize's legacy order (kind groups, then group/version/kind, then namespace and
name), as `kubectl kustomize` prints it.
"""

from __future__ import annotations

import copy
import glob
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
KUBECTL_TIMEOUT_S = 60.0


class KustomizeError(ValueError):
    """The tree uses something this renderer does not support, or is malformed."""


# --- kubectl ---------------------------------------------------------------------------------


def find_kubectl() -> Path | None:
    """kubectl on PATH, else the one tools/controlplane/build.sh cached; None when neither."""
    on_path = shutil.which("kubectl")
    if on_path:
        return Path(on_path)
    cache_root = os.environ.get("CD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "computedomains"
    )
    found = sorted(glob.glob(os.path.join(cache_root, "controlplane", "*", "kubectl")))
    executable = [Path(p) for p in found if os.access(p, os.X_OK)]
    return executable[-1] if executable else None


def build_kubectl(path: Path, kubectl: Path) -> list[Obj]:
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=KUBECTL_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


def build(path: Path) -> list[Obj]:
    """Render with `kubectl kustomize` if there is a kubectl, else with the Python renderer."""
    kubectl = find_kubectl()
    return build_kubectl(path, kubectl) if kubectl is not None else build_python(path)


# --- the Python renderer ---------------------------------------------------------------------


def build_python(path: Path) -> list[Obj]:
    return sort_legacy(_build(Path(path).resolve(), stack=()))


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise KustomizeError(f"{directory} has no kustomization file")


def _load_yaml_docs(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _build(directory: Path, stack: tuple[Path, ...]) -> list[Obj]:
    if directory in stack:
        raise KustomizeError(f"kustomization cycle through {directory}")
    kfile = _kustomization_file(directory)
    docs = _load_yaml_docs(kfile)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise KustomizeError(f"{kfile} must hold one mapping")
    kust: dict[str, Any] = docs[0]
    unsupported = sorted(set(kust) - _SUPPORTED_FIELDS)
    if unsupported:
        raise KustomizeError(f"{kfile}: unsupported field(s) {', '.join(unsupported)}")

    objects: list[Obj] = []
    for entry in kust.get("resources") or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(_build(target, (*stack, directory)))
        elif target.is_file():
            for doc in _load_yaml_docs(target):
                if not isinstance(doc, dict):
                    raise KustomizeError(f"{target}: a resource document must be a mapping")
                _check_object(doc, target)
                objects.append(doc)
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} does not exist")
    _check_unique(objects, kfile)

    for patch in kust.get("patches") or []:
        _apply_patch_entry(objects, patch, directory, kfile)
    for image in kust.get("images") or []:
        _apply_image(objects, image, kfile)
    return objects


def _check_object(obj: Obj, source: Path) -> None:
    meta = obj.get("metadata")
    if not obj.get("apiVersion") or not obj.get("kind") or not isinstance(meta, dict) or not meta.get("name"):
        raise KustomizeError(f"{source}: every object needs apiVersion, kind and metadata.name")


def object_id(obj: Obj) -> tuple[str, str, str, str]:
    """(group, kind, namespace, name): how kustomize tells resources apart."""
    group = obj["apiVersion"].rpartition("/")[0]
    meta = obj.get("metadata") or {}
    return group, obj["kind"], meta.get("namespace") or "", meta["name"]


def _check_unique(objects: list[Obj], kfile: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        key = object_id(obj)
        if key in seen:
            raise KustomizeError(f"{kfile}: {key} is defined twice")
        seen.add(key)


# --- patches ---------------------------------------------------------------------------------


def _apply_patch_entry(objects: list[Obj], entry: dict[str, Any], directory: Path, kfile: Path) -> None:
    unknown = sorted(set(entry) - {"path", "patch", "target"})
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported patch field(s) {', '.join(unknown)}")
    if ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{kfile}: a patch needs exactly one of path and patch")
    if "path" in entry:
        docs = _load_yaml_docs((directory / entry["path"]).resolve())
    else:
        docs = [d for d in yaml.safe_load_all(entry["patch"]) if d is not None]
    target = entry.get("target")
    if len(docs) == 1 and isinstance(docs[0], list):
        if target is None:
            raise KustomizeError(f"{kfile}: a JSON 6902 patch needs a target")
        matched = _select(objects, target)
        if not matched:
            raise KustomizeError(f"{kfile}: patch target {target} matches nothing")
        for obj in matched:
            _replace_in_place(obj, apply_json6902(obj, docs[0]))
        return
    for doc in docs:
        if not isinstance(doc, dict):
            raise KustomizeError(f"{kfile}: a strategic-merge patch must be a mapping")
        if target is not None:
            matched = _select(objects, target)
        else:
            _check_object(doc, kfile)
            key = object_id(doc)
            matched = [o for o in objects if object_id(o) == key]
        if not matched:
            raise KustomizeError(f"{kfile}: strategic-merge patch for {doc.get('kind')} matches nothing")
        for obj in matched:
            _replace_in_place(obj, strategic_merge(obj, doc))


def _replace_in_place(obj: Obj, new: Obj) -> None:
    obj.clear()
    obj.update(new)


def _select(objects: Iterable[Obj], target: dict[str, Any]) -> list[Obj]:
    unknown = sorted(set(target) - {"group", "version", "kind", "name", "namespace"})
    if unknown:
        raise KustomizeError(f"unsupported patch target field(s) {', '.join(unknown)}")
    result = []
    for obj in objects:
        group, _, version = obj["apiVersion"].rpartition("/")
        meta = obj.get("metadata") or {}
        actual = {
            "group": group,
            "version": version,
            "kind": obj["kind"],
            "name": meta.get("name"),
            "namespace": meta.get("namespace") or "",
        }
        if all(actual[k] == v for k, v in target.items()):
            result.append(obj)
    return result


# Strategic merge: lists of these fields merge by the key; every other list is replaced.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
}


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":  # container ports merge by containerPort, Service ports by port
        dicts = [i for i in items if isinstance(i, dict)]
        return "containerPort" if dicts and all("containerPort" in i for i in dicts) else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge(original: Obj, patch: Obj) -> Obj:
    """`patch` merged into a copy of `original` (null deletes a key; keyed lists merge)."""
    return _merge_map(copy.deepcopy(original), patch)


def _merge_map(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if isinstance(key, str) and key.startswith("$"):
            raise KustomizeError(f"unsupported strategic-merge directive {key}")
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _merge_map(base[key], value)
        elif isinstance(value, list) and isinstance(base.get(key), list):
            merge_key = _merge_key(key, value + base[key])
            base[key] = _merge_list(base[key], value, merge_key) if merge_key else copy.deepcopy(value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    """Kustomize's order: the patch's items (merged into their originals) first, then the rest."""
    originals = {item.get(key): item for item in base if isinstance(item, dict)}
    merged: list[Any] = []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise KustomizeError(f"strategic-merge list item without its merge key {key!r}: {item!r}")
        existing = originals.pop(item[key], None)
        merged.append(_merge_map(existing, item) if existing is not None else copy.deepcopy(item))
    patched = {item[key] for item in patch}
    return merged + [item for item in base if not (isinstance(item, dict) and item.get(key) in patched)]


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise KustomizeError(f"JSON patch path {path}: {token!r} does not exist")
        return node[token]
    if isinstance(node, list):
        index = _index(node, token, path, allow_end=False)
        return node[index]
    raise KustomizeError(f"JSON patch path {path}: cannot descend into a scalar")


def _index(node: list[Any], token: str, path: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise KustomizeError(f"JSON patch path {path}: {token!r} is not a list index")
    index = int(token)
    limit = len(node) if allow_end else len(node) - 1
    if index > limit:
        raise KustomizeError(f"JSON patch path {path}: index {index} out of range")
    return index


def apply_json6902(obj: Obj, operations: list[dict[str, Any]]) -> Obj:
    """RFC 6902 add / remove / replace / test on a copy of `obj`."""
    doc = copy.deepcopy(obj)
    for op in operations:
        kind, path = op.get("op"), op.get("path")
        if not isinstance(path, str):
            raise KustomizeError(f"JSON patch operation without a path: {op!r}")
        tokens = _pointer(path)
        if not tokens:
            raise KustomizeError("JSON patch on the whole document is not supported")
        parent = doc
        for token in tokens[:-1]:
            parent = _child(parent, token, path)
        last = tokens[-1]
        if kind == "test":
            if _child(parent, last, path) != op.get("value"):
                raise KustomizeError(f"JSON patch test failed at {path}")
        elif kind == "remove":
            if isinstance(parent, dict):
                _child(parent, last, path)
                del parent[last]
            else:
                del parent[_index(parent, last, path, allow_end=False)]
        elif kind in ("add", "replace"):
            if "value" not in op:
                raise KustomizeError(f"JSON patch {kind} at {path} without a value")
            value = copy.deepcopy(op["value"])
            if isinstance(parent, dict):
                if kind == "replace":
                    _child(parent, last, path)
                parent[last] = value
            elif isinstance(parent, list):
                if kind == "add":
                    parent.insert(_index(parent, last, path, allow_end=True), value)
                else:
                    parent[_index(parent, last, path, allow_end=False)] = value
            else:
                raise KustomizeError(f"JSON patch path {path}: parent is a scalar")
        else:
            raise KustomizeError(f"unsupported JSON patch operation {kind!r}")
    return doc


# --- images ----------------------------------------------------------------------------------


def split_image(image: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a registry port is not a tag."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest


def _pod_specs(obj: Obj) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return [spec]
    if obj["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template") or {}
    return [template["spec"]] if isinstance(template.get("spec"), dict) else []


def _apply_image(objects: list[Obj], image: dict[str, Any], kfile: Path) -> None:
    unknown = sorted(set(image) - {"name", "newName", "newTag", "digest"})
    if unknown or "name" not in image:
        raise KustomizeError(f"{kfile}: unsupported image entry {image!r}")
    for obj in objects:
        for pod_spec in _pod_specs(obj):
            for field in ("initContainers", "containers"):
                for container in pod_spec.get(field) or []:
                    name, tag, digest = split_image(container.get("image", ""))
                    if name != image["name"]:
                        continue
                    new = str(image.get("newName", name))
                    if image.get("digest"):
                        container["image"] = f"{new}@{image['digest']}"
                    elif "newTag" in image:
                        container["image"] = f"{new}:{image['newTag']}"
                    elif digest:
                        container["image"] = f"{new}@{digest}"
                    else:
                        container["image"] = f"{new}:{tag}" if tag else new


# --- output order ----------------------------------------------------------------------------

_ORDER_FIRST = (
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
)
_ORDER_LAST = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def _legacy_key(obj: Obj) -> tuple[int, str, str, str]:
    kind = obj["kind"]
    if kind in _ORDER_FIRST:
        rank = _ORDER_FIRST.index(kind) - len(_ORDER_FIRST)
    elif kind in _ORDER_LAST:
        rank = _ORDER_LAST.index(kind) + 1
    else:
        rank = 0
    group, _, version = obj["apiVersion"].rpartition("/")
    gvk = "_".join((group or "~G", version or "~V", kind or "~K"))
    meta = obj.get("metadata") or {}
    return rank, gvk, meta.get("namespace") or "~X", meta["name"]


def sort_legacy(objects: list[Obj]) -> list[Obj]:
    return sorted(objects, key=_legacy_key)
