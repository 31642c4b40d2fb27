"""RBAC least privilege: the rendered Roles grant each component exactly the API calls its code makes.

The calls are read from the services' source (tests/security/kube_calls.py); the grants from the
rendered kustomize trees (base and both overlays). A verb granted but never called, or a call
without its grant, fails with the place in the code (or the Role rule) to look at.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import yaml

from tests.manifests.kustomize import build
from tests.manifests.objects import MANIFESTS, TREES, Obj
from tests.manifests.test_rbac import granted_permissions
from tests.security.kube_calls import (
    REPO_ROOT,
    ApiCall,
    Permission,
    UnresolvedCall,
    calls_in_source,
    calls_in_tree,
    permission_of,
)

COMPONENT_CODE = {
    "controller": REPO_ROOT / "services" / "controller",
    "node-agent": REPO_ROOT / "services" / "nodeagent",
    "placement-advisor": REPO_ROOT / "services" / "advisor",
}
USAGE = yaml.safe_load((MANIFESTS / "rbac-usage.yaml").read_text())["components"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: build(path) for name, path in TREES.items()}


@pytest.fixture(scope="module")
def code_calls() -> dict[str, list[ApiCall]]:
    return {component: calls_in_tree(root) for component, root in COMPONENT_CODE.items()}


def _used(calls: list[ApiCall]) -> set[Permission]:
    return {c.permission for c in calls}


def _show(permissions: set[Permission]) -> str:
    return ", ".join(f"{verb} {group or 'core'}/{resource}" for group, resource, verb in sorted(permissions))


def test_every_component_with_rbac_has_its_code_scanned() -> None:
    assert set(USAGE) == set(COMPONENT_CODE)


@pytest.mark.parametrize("component", sorted(COMPONENT_CODE))
@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_call_the_code_makes_is_granted(
    rendered: dict[str, list[Obj]], code_calls: dict[str, list[ApiCall]], tree: str, component: str
) -> None:
    granted = granted_permissions(rendered[tree], USAGE[component]["serviceAccount"])
    missing = [c for c in code_calls[component] if c.permission not in granted]
    assert not missing, f"{tree}: {component} calls without a grant (403 at run time):\n" + "\n".join(
        f"  {c}" for c in missing
    )


@pytest.mark.parametrize("component", sorted(COMPONENT_CODE))
@pytest.mark.parametrize("tree", sorted(TREES))
def test_nothing_is_granted_that_the_code_does_not_call(
    rendered: dict[str, list[Obj]], code_calls: dict[str, list[ApiCall]], tree: str, component: str
) -> None:
    granted = granted_permissions(rendered[tree], USAGE[component]["serviceAccount"])
    unused = granted - _used(code_calls[component])
    assert not unused, f"{tree}: {component} is granted what its code never calls: {_show(unused)}"


@pytest.mark.parametrize("component", sorted(COMPONENT_CODE))
def test_usage_file_lists_exactly_the_calls_of_the_code(
    code_calls: dict[str, list[ApiCall]], component: str
) -> None:
    listed = {(c["group"], c["resource"], v) for c in USAGE[component]["calls"] for v in c["verbs"]}
    used = _used(code_calls[component])
    assert listed == used, (
        f"manifests/rbac-usage.yaml, {component}: listed but not called: {_show(listed - used)}; "
        f"called but not listed: {_show(used - listed)}"
    )


IMEX_AGENT_ACCOUNT = "compute-domains-system/cd-imex-agent"


@pytest.mark.parametrize("tree", sorted(TREES))
def test_the_imex_agent_calls_no_kubernetes_api_and_holds_no_grant_or_token(
    rendered: dict[str, list[Obj]], tree: str
) -> None:
    # Its only identity is its etcd client certificate: a stolen pod gets nothing from the API.
    assert calls_in_tree(REPO_ROOT / "services" / "imexagent") == []
    assert granted_permissions(rendered[tree], IMEX_AGENT_ACCOUNT) == set()
    namespace, _, name = IMEX_AGENT_ACCOUNT.partition("/")
    [account] = [
        o
        for o in rendered[tree]
        if o["kind"] == "ServiceAccount"
        and (o["metadata"].get("namespace"), o["metadata"]["name"]) == (namespace, name)
    ]
    assert account.get("automountServiceAccountToken") is False
    [daemonset] = [o for o in rendered[tree] if o["kind"] == "DaemonSet" and o["metadata"]["name"] == name]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod.get("automountServiceAccountToken") is False


def test_the_components_do_call_the_api() -> None:
    # Guards the scanner itself: if it stopped seeing calls, every comparison above would be vacuous.
    calls = {component: calls_in_tree(root) for component, root in COMPONENT_CODE.items()}
    assert ("resource.k8s.io", "resourceslices", "create") in _used(calls["node-agent"])
    assert ("resource.nvidia.com", "computedomains", "watch") in _used(calls["controller"])
    assert ("resource.k8s.io", "resourceclaimtemplates", "get") in _used(calls["placement-advisor"])


# ---- the scanner on known shapes of calls -----------------------------------------------------

SAMPLE = """
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi, ResourceV1Api

async def f(api, name):
    core = CoreV1Api(api)
    await core.patch_node_status(name, {})
    await core.list_namespaced_pod("ns", watch=True)
    await ResourceV1Api(api).delete_collection_namespaced_resource_claim("ns")
    custom = CustomObjectsApi(api)
    await custom.get_namespaced_custom_object(GROUP, "v1", "ns", consts.PLURAL, name)
    async with watch.Watch() as w:
        async for _ in w.stream(custom.list_namespaced_custom_object, group=GROUP, version="v1",
                                namespace="ns", plural="widgets"):
            pass
    await api.call_api("/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale", "PUT")
"""


def _sample_calls(source: str) -> list[ApiCall]:
    module = types.SimpleNamespace(GROUP="example.com", consts=types.SimpleNamespace(PLURAL="gadgets"))
    return list(calls_in_source(source, "sample.py", lambda: module))


def test_scanner_maps_each_shape_of_call_to_its_permission() -> None:
    assert [c.permission for c in _sample_calls(SAMPLE)] == [
        ("", "nodes/status", "patch"),
        ("", "pods", "watch"),
        ("resource.k8s.io", "resourceclaims", "deletecollection"),
        ("example.com", "gadgets", "get"),
        ("example.com", "widgets", "watch"),
        ("apps", "deployments/scale", "update"),
    ]


def test_scanner_refuses_what_it_cannot_resolve() -> None:
    source = (
        "from kubernetes_asyncio.client import CustomObjectsApi\n"
        "async def f(api, group):\n"
        "    await CustomObjectsApi(api).list_cluster_custom_object(group, 'v1', 'things')\n"
    )
    with pytest.raises(UnresolvedCall, match="cannot resolve group"):
        _sample_calls(source)


@pytest.mark.parametrize(
    ("path", "method", "expected"),
    [
        ("/api/v1/nodes", "GET", ("", "nodes", "list")),
        ("/api/v1/nodes/{name}", "GET", ("", "nodes", "get")),
        ("/api/v1/namespaces/{name}", "DELETE", ("", "namespaces", "delete")),
        ("/api/v1/namespaces/{namespace}/events", "POST", ("", "events", "create")),
        (
            "/apis/resource.k8s.io/v1/resourceslices/{name}",
            "PUT",
            ("resource.k8s.io", "resourceslices", "update"),
        ),
    ],
)
def test_permission_of_a_request(path: str, method: str, expected: Permission) -> None:
    assert permission_of(path, method) == expected


def _iter_rules(objects: list[Obj]) -> Iterator[tuple[str, dict[str, object]]]:
    for role in objects:
        if role["kind"] in ("Role", "ClusterRole"):
            for rule in role.get("rules") or []:
                yield role["metadata"]["name"], rule


def test_every_rule_serves_some_component(rendered: dict[str, list[Obj]]) -> None:
    # A Role bound to nobody (or to another account) would escape the per-component comparison.
    bound = {
        b["roleRef"]["name"]
        for b in rendered["base"]
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(
            f"{s.get('namespace')}/{s['name']}" in {u["serviceAccount"] for u in USAGE.values()}
            for s in b.get("subjects") or []
        )
    }
    for name, _ in _iter_rules(rendered["base"]):
        assert name in bound, f"Role {name} is bound to no component's service account"
