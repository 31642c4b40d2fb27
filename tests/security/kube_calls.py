"""Which Kubernetes API calls a component's code makes, found by reading its source (AST).

Each call is turned into the RBAC permission it needs, (API group, resource, verb):

* typed calls of kubernetes-asyncio API classes (`CoreV1Api.patch_node`,
  `ResourceV1Api.read_namespaced_resource_claim`, ...): the HTTP method and path are read from
  the client library's own `<method>_with_http_info`, so nothing is guessed from method names;
* `CustomObjectsApi` calls: the same, with `group` and `plural` taken from the call's arguments
  (literals, or names resolved in the calling module);
* raw `ApiClient.call_api(path, method, ...)` calls, from their literal path and method, or a path
  built in the call by `libs.kube.resource_api.resource_path(version, plural, namespace, name)`;
* `libs.kube.resource_api.typed_api(...)`, the typed client of the served resource.k8s.io version:
  read as `ResourceV1Api` (every version has the same methods, group and resource names);
* a list method handed to `Watch().stream(...)`, or called with `watch=True`: verb watch.

GET on an object is get, on a collection list; POST create; PUT update; PATCH patch; DELETE on an
object delete, on a collection deletecollection. A call this module cannot resolve raises
`UnresolvedCall`, so a new kind of call cannot slip past the RBAC comparison unseen.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_asyncio.client as k8s_client

REPO_ROOT = Path(__file__).resolve().parents[2]

Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)

_CALL_API = re.compile(r"call_api\(\s*'([^']+)',\s*'([A-Z]+)'")
_HTTP_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


class UnresolvedCall(ValueError):
    """A Kubernetes call whose permission cannot be worked out from the source."""


@dataclass(frozen=True)
class ApiCall:
    permission: Permission
    where: str  # path:line and the method called

    def __str__(self) -> str:
        group, resource, verb = self.permission
        return f"{verb} {group or 'core'}/{resource} at {self.where}"


@cache
def api_classes() -> dict[str, type]:
    """The API classes of kubernetes_asyncio.client (CoreV1Api, CustomObjectsApi, ...)."""
    return {
        name: cls
        for name, cls in vars(k8s_client).items()
        if inspect.isclass(cls) and name.endswith("Api") and name != "ApiClient"
    }


@cache
def http_of(class_name: str, method: str) -> tuple[str, str]:
    """(path template, HTTP method) that `class_name.method` sends, read from the client library."""
    cls = api_classes()[class_name]
    source = inspect.getsource(getattr(cls, f"{method}_with_http_info"))
    found = _CALL_API.search(source)
    if found is None:
        raise UnresolvedCall(f"{class_name}.{method}: no call_api(path, method) in the client library")
    return found.group(1), found.group(2)


def permission_of(path: str, http_method: str, watch: bool = False) -> Permission:
    """The RBAC permission of one request, from its path template and HTTP method."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        raise UnresolvedCall(f"not a resource path: {path}")
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[1].startswith("{"):
        rest = rest[2:]  # namespaced: the namespace is not part of the RBAC resource
    if not rest:
        raise UnresolvedCall(f"no resource in path {path}")
    resource, named, subresource = rest[0], len(rest) >= 2, rest[2] if len(rest) >= 3 else ""
    if http_method == "GET":
        verb = "watch" if watch else ("get" if named else "list")
    elif http_method == "DELETE":
        verb = "delete" if named else "deletecollection"
    elif http_method in _HTTP_VERBS:
        verb = _HTTP_VERBS[http_method]
    else:
        raise UnresolvedCall(f"HTTP method {http_method} of {path}")
    return group, resource + (f"/{subresource}" if subresource else ""), verb


# ---- reading the source ----------------------------------------------------------------------


def _module_of(path: Path) -> Any:
    dotted = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return importlib.import_module(dotted)


def _resolve(node: ast.expr, module: Any, where: str) -> object:
    """The value of a literal, a module-level name, or an attribute of one."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and hasattr(module, node.id):
        return getattr(module, node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, module, where)
        if hasattr(base, node.attr):
            return getattr(base, node.attr)
    raise UnresolvedCall(f"{where}: cannot resolve {ast.unparse(node)} to a value")


def _referenced_api_classes(tree: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    if "typed_api" in names:
        names.add("ResourceV1Api")
    return names & set(api_classes())


def _resource_path(call: ast.Call, module: Any, where: str) -> str:
    """The path template of a `resource_path(version, plural, namespace="", name="")` call."""
    args = dict(zip(("version", "plural", "namespace", "name"), call.args, strict=False))
    args.update({k.arg: k.value for k in call.keywords if k.arg})
    if "plural" not in args:
        raise UnresolvedCall(f"{where}: resource_path without a plural")
    path = f"/apis/resource.k8s.io/v1/{_resolve(args['plural'], module, where)}"
    if "namespace" in args:
        path = path.replace("/v1/", "/v1/namespaces/{namespace}/")
    if "name" in args:
        path += "/{name}"
    return path


def _owner(method: str, classes: set[str], where: str) -> str | None:
    owners = sorted(c for c in classes if callable(getattr(api_classes()[c], method, None)))
    if len(owners) > 1:
        raise UnresolvedCall(f"{where}: {method} exists on {owners}; cannot tell which is called")
    return owners[0] if owners else None


def _bind(class_name: str, method: str, call: ast.Call, skip_first: bool) -> dict[str, ast.expr]:
    """The call's arguments by parameter name (from the client method's signature)."""
    params = [
        p.name
        for p in inspect.signature(getattr(api_classes()[class_name], method)).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    args = call.args[1:] if skip_first else call.args
    bound = {name: arg for name, arg in zip(params, args, strict=False)}
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound


def _typed_permission(
    class_name: str, method: str, call: ast.Call, module: Any, where: str, watch: bool, skip_first: bool
) -> Permission:
    path, http_method = http_of(class_name, method)
    bound = _bind(class_name, method, call, skip_first)
    watch_arg = bound.get("watch")
    if watch_arg is not None and _resolve(watch_arg, module, where) is True:
        watch = True
    if "{group}" in path or "{plural}" in path:
        for name in ("group", "plural"):
            if name not in bound:
                raise UnresolvedCall(f"{where}: {method} without a {name} argument")
            value = _resolve(bound[name], module, where)
            if not isinstance(value, str):
                raise UnresolvedCall(f"{where}: {name} of {method} is {value!r}, not a string")
            path = path.replace("{" + name + "}", value)
    return permission_of(path, http_method, watch)


def calls_in_source(source: str, name: str, module: Callable[[], Any]) -> Iterator[ApiCall]:
    """The calls in one module's source; `module()` gives the imported module (to resolve names)."""
    if "kubernetes_asyncio" not in source:
        return
    tree = ast.parse(source, name)
    classes = _referenced_api_classes(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        where = f"{name}:{node.lineno} {node.func.attr}"
        if node.func.attr == "call_api":
            if len(node.args) < 2:
                raise UnresolvedCall(f"{where}: call_api without literal path and method")
            first = node.args[0]
            if isinstance(first, ast.Call) and getattr(first.func, "id", "") == "resource_path":
                api_path = _resource_path(first, module(), where)
                http_method = _resolve(node.args[1], module(), where)
            else:
                api_path, http_method = (_resolve(a, module(), where) for a in node.args[:2])
            yield ApiCall(permission_of(str(api_path), str(http_method)), where)
            continue
        if node.func.attr == "stream" and node.args and isinstance(node.args[0], ast.Attribute):
            method = node.args[0].attr
            owner = _owner(method, classes, where)
            if owner is not None:
                perm = _typed_permission(owner, method, node, module(), where, watch=True, skip_first=True)
                yield ApiCall(perm, f"{name}:{node.lineno} Watch.stream({method})")
            continue
        owner = _owner(node.func.attr, classes, where)
        if owner is None:
            continue
        yield ApiCall(
            _typed_permission(owner, node.func.attr, node, module(), where, watch=False, skip_first=False),
            where,
        )


def calls_in_file(path: Path) -> list[ApiCall]:
    rel = path.relative_to(REPO_ROOT)
    return list(calls_in_source(path.read_text(), str(rel), lambda: _module_of(path)))


def calls_in_tree(root: Path) -> list[ApiCall]:
    """Every Kubernetes API call under `root` (a service package), in file order."""
    root = root.resolve()
    return [call for path in sorted(root.rglob("*.py")) for call in calls_in_file(path)]
