"""Offline stand-in for what the API server does with a CRD's structural schema.

`CrdValidator(crd).validate(obj, old=None)` applies the schema's defaults, checks the object against
the OpenAPI v3 schema (as JSON Schema; unknown fields are errors, as with kubectl's default strict
field validation), checks list-map key uniqueness, and evaluates the CEL `x-kubernetes-validations`
rules with cel-python (transition rules that use `oldSelf` only when `old` has the value, as on an
update). It returns the error messages; the real API server test lives with the end-to-end tests.

`structural_problems(schema)` lists violations of the API server's structural-schema rules that
would make it refuse the CRD.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

Schema = dict[str, Any]

_JSON_SCHEMA_KEYWORDS = (
    "type",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "required",
)


def to_json_schema(node: Schema, *, root: bool = True) -> Schema:
    """The OpenAPI v3 node as JSON Schema; objects with properties reject unknown fields."""
    out: Schema = {k: copy.deepcopy(node[k]) for k in _JSON_SCHEMA_KEYWORDS if k in node}
    if "properties" in node:
        out["properties"] = {
            name: to_json_schema(sub, root=False) for name, sub in node["properties"].items()
        }
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"], root=False)
    if "items" in node:
        out["items"] = to_json_schema(node["items"], root=False)
    if root:
        out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def apply_defaults(node: Schema, value: Any) -> Any:
    """Structural defaulting: a missing field with a default gets it, recursively."""
    if isinstance(value, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in node:
        return [apply_defaults(node["items"], item) for item in value]
    return value


@dataclass(frozen=True)
class _Rule:
    path: tuple[str, ...]  # property names from the root to the node the rule is on
    rule: str
    message: str
    program: Any
    transition: bool


def _rules(node: Schema, path: tuple[str, ...], env: celpy.Environment) -> list[_Rule]:
    found = []
    for spec in node.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(spec["rule"]))
        message = spec.get("message") or f"failed rule: {spec['rule']}"
        found.append(_Rule(path, spec["rule"], message, program, "oldSelf" in spec["rule"]))
    for name, sub in (node.get("properties") or {}).items():
        found.extend(_rules(sub, (*path, name), env))
    if "items" in node and node["items"].get("x-kubernetes-validations"):
        raise NotImplementedError("CEL rules inside list items are not evaluated offline")
    return found


_MISSING: Any = object()


def _lookup(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(obj, dict) or name not in obj:
            return _MISSING
        obj = obj[name]
    return obj


def _list_map_duplicates(node: Schema, value: Any, where: str) -> list[str]:
    errors: list[str] = []
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                errors.extend(_list_map_duplicates(sub, value[name], f"{where}.{name}"))
    elif isinstance(value, list) and "items" in node:
        if node.get("x-kubernetes-list-type") == "map":
            keys = node.get("x-kubernetes-list-map-keys") or []
            seen = set()
            for item in value:
                key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else (item,)
                if key in seen:
                    errors.append(f"{where}: Duplicate value: {dict(zip(keys, key, strict=True))}")
                seen.add(key)
        for i, item in enumerate(value):
            errors.extend(_list_map_duplicates(node["items"], item, f"{where}[{i}]"))
    return errors


class CrdValidator:
    """Validation of one served version of a CRD, the way the API server would do it."""

    def __init__(self, crd: dict[str, Any], version: str | None = None) -> None:
        versions = crd["spec"]["versions"]
        chosen = next(v for v in versions if version is None or v["name"] == version)
        self.schema: Schema = chosen["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft202012Validator(
            to_json_schema(self.schema), format_checker=jsonschema.FormatChecker()
        )
        self.rules = _rules(self.schema, (), celpy.Environment())

    def default(self, obj: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = apply_defaults(self.schema, copy.deepcopy(obj))
        return result

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        """Error messages for creating `obj` (or updating `old` to `obj`); [] = accepted."""
        new = self.default(obj)
        previous = self.default(old) if old is not None else None
        errors = [
            f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(self.validator.iter_errors(new), key=lambda e: list(e.absolute_path))
        ]
        errors.extend(_list_map_duplicates(self.schema, new, "<root>"))
        if errors:
            return errors  # the API server skips CEL rules on structurally invalid objects
        for rule in self.rules:
            value = _lookup(new, rule.path)
            if value is _MISSING:
                continue
            activation = {"self": celpy.json_to_cel(value)}
            if rule.transition:
                old_value = _lookup(previous, rule.path) if previous is not None else _MISSING
                if old_value is _MISSING:
                    continue
                activation["oldSelf"] = celpy.json_to_cel(old_value)
            where = ".".join(rule.path) or "<root>"
            try:
                result = rule.program.evaluate(activation)
            except celpy.CELEvalError as exc:
                errors.append(f"{where}: rule {rule.rule!r} could not be evaluated: {exc}")
                continue
            if isinstance(result, Exception) or result != celpy.celtypes.BoolType(True):
                errors.append(f"{where}: Invalid value: {rule.message}")
        return errors


def structural_problems(node: Schema, path: str = "<root>", *, root: bool = True) -> list[str]:
    """Why the API server would refuse this schema as structural ([] = it would not)."""
    problems: list[str] = []
    open_ended = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in node and not open_ended:
        problems.append(f"{path}: type is required")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties are mutually exclusive")
    if root and "metadata" in (node.get("properties") or {}):
        extra = set(node["properties"]["metadata"].get("properties") or {}) - {"name", "generateName"}
        if extra:
            problems.append(
                f"{path}.metadata: only name and generateName may be specified, not {sorted(extra)}"
            )
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: an array needs items")
    if node.get("x-kubernetes-list-type") == "map":
        items = node.get("items") or {}
        if items.get("type") != "object":
            problems.append(f"{path}: a map list needs object items")
        keys = node.get("x-kubernetes-list-map-keys") or []
        if not keys:
            problems.append(f"{path}: a map list needs x-kubernetes-list-map-keys")
        for key in keys:
            key_schema = (items.get("properties") or {}).get(key)
            if key_schema is None:
                problems.append(f"{path}: map key {key} is not a property of the items")
            elif key not in (items.get("required") or []) and "default" not in key_schema:
                problems.append(f"{path}: map key {key} must be required or defaulted")
            elif key_schema.get("type") not in ("string", "integer", "boolean", "number"):
                problems.append(f"{path}: map key {key} must be a scalar")
    if "default" in node:
        sub_validator = jsonschema.Draft202012Validator(to_json_schema(node))
        for e in sub_validator.iter_errors(apply_defaults(node, copy.deepcopy(node["default"]))):
            problems.append(f"{path}: default {node['default']!r} is invalid: {e.message}")
    for name, sub in (node.get("properties") or {}).items():
        problems.extend(structural_problems(sub, f"{path}.{name}", root=False))
    if isinstance(node.get("items"), dict):
        problems.extend(structural_problems(node["items"], f"{path}[*]", root=False))
    return problems
