"""What a CDI spec must pass to be loaded: the published JSON schema, plus the Go loader's extras.

Both come from the CDI project's Go module, put into the per-user cache by tools/cdi/build.sh
(`make setup`): the JSON schema (schema.json, defs.json, testdata/) and ``cdi-check``, the CDI
package itself loading spec dirs as runtimes do (``cdi_check``). The schema
does not forbid unknown fields, but the loader decodes strictly (yaml.UnmarshalStrict), so
``unknown_fields`` walks a spec against the properties the schema declares; the loader also knows
``fileMode`` on device nodes, which the schema lacks. ``loader_violations`` restates the loader's
semantic checks (names, env, device node type/permissions, non-empty device edits).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tools.cached_tool import BuildError, cached_tool

REPO_ROOT = Path(__file__).resolve().parents[2]


# Fields the Go loader accepts beyond the schema's declared properties, keyed by definition
# ("Spec" is the spec itself: its top-level containerEdits is in the Go Spec type but missing
# from schema.json of the release tools/cdi/build.sh takes the schema from).
LOADER_EXTRA_FIELDS = {"Spec": {"containerEdits"}, "DeviceNode": {"fileMode"}}


@functools.cache
def cdi_tools_dir() -> Path:
    """The cache folder of tools/cdi/build.sh; fails (never skips) when `make setup` has not made it."""
    try:
        return cached_tool("tools/cdi/build.sh", "--cached-only")
    except BuildError as exc:
        pytest.fail(f"the CDI schema and cdi-check are not in the cache: {exc}", pytrace=False)


def schema_dir() -> Path:
    return cdi_tools_dir() / "schema"


def cdi_check(*spec_dirs: Path) -> dict[str, Any]:
    """What the CDI Go package makes of spec dirs: {"errors": {path or device: [msg]},
    "devices": [qualified name], "injected": {device: OCI spec after injecting it alone}}."""
    proc = subprocess.run(
        [str(cdi_tools_dir() / "cdi-check"), *map(str, spec_dirs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@functools.cache
def load_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    d = schema_dir()
    return json.loads((d / "schema.json").read_text()), json.loads((d / "defs.json").read_text())


@functools.cache
def schema_validator() -> Draft7Validator:
    schema, defs = load_schemas()
    registry: Registry = Registry().with_resource("defs.json", Resource.from_contents(defs, DRAFT7))
    return Draft7Validator(schema, registry=registry)


def schema_errors(spec: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in schema_validator().iter_errors(spec)
    ]


def unknown_fields(spec: Any) -> list[str]:
    """Paths of object keys the schema does not declare (strict decoding would reject them)."""
    schema, defs = load_schemas()
    found: list[str] = []

    def resolve(node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        ref = node.get("$ref")
        if ref is None:
            return node, None
        _, _, pointer = ref.partition("#")
        name = pointer.rsplit("/", 1)[-1]
        return resolve(defs["definitions"][name])[0], name

    def walk(value: Any, node: dict[str, Any], path: str, name: str | None = None) -> None:
        node, def_name = resolve(node)
        def_name = def_name or name
        if isinstance(value, dict) and "properties" in node:
            allowed = set(node["properties"]) | LOADER_EXTRA_FIELDS.get(def_name or "", set())
            for key, child in value.items():
                if key not in allowed:
                    found.append(f"{path}/{key}")
                elif isinstance(node["properties"].get(key), dict):
                    walk(child, node["properties"][key], f"{path}/{key}")
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                walk(item, node["items"], f"{path}/{i}")

    walk(spec, schema, "", "Spec")
    return found


_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def loader_violations(spec: dict[str, Any]) -> list[str]:
    """The Go loader's semantic checks other than the version rule."""
    problems: list[str] = []
    vendor, _, cls = spec["kind"].partition("/")
    for part in (vendor, cls):
        if not _VENDOR_OR_CLASS.fullmatch(part):
            problems.append(f"bad vendor/class {part!r}")
    devices = spec.get("devices") or []
    if not devices:
        problems.append("no devices")
    names = [d["name"] for d in devices]
    if len(set(names)) != len(names):
        problems.append("duplicate device names")
    edit_blocks = [spec.get("containerEdits") or {}]
    for d in devices:
        if not _DEVICE_NAME.fullmatch(d["name"]):
            problems.append(f"bad device name {d['name']!r}")
        edits = d.get("containerEdits") or {}
        if not any(
            edits.get(k) for k in ("env", "deviceNodes", "hooks", "mounts", "additionalGids", "intelRdt")
        ):
            problems.append(f"device {d['name']!r} has empty containerEdits")
        edit_blocks.append(edits)
    for edits in edit_blocks:
        for var in edits.get("env") or []:
            if not isinstance(var, str) or var.find("=") <= 0:
                problems.append(f"bad env {var!r}")
        for node in edits.get("deviceNodes") or []:
            if not node.get("path"):
                problems.append("device node without path")
            if node.get("type", "") not in ("", "b", "c", "u", "p"):
                problems.append(f"bad device type {node.get('type')!r}")
            perms = node.get("permissions", "")
            if perms not in ("", "none") and perms.strip("rwm"):
                problems.append(f"bad permissions {perms!r}")
            if node.get("type") in ("b", "c") and not node.get("major"):
                # Not minimally specified: the runtime must stat the host node, which may not exist.
                problems.append(f"{node['path']}: char/block device without major")
            if "fileMode" in node and not (
                isinstance(node["fileMode"], int) and 0 <= node["fileMode"] < 2**32
            ):
                problems.append(f"bad fileMode {node['fileMode']!r}")
    return problems
