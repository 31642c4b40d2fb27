"""RBAC grants each component exactly the API calls manifests/rbac-usage.yaml lists, nothing more."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.manifests.objects import MANIFESTS, NAMESPACE, Obj, find, of_kind, pod_spec

USAGE = yaml.safe_load((MANIFESTS / "rbac-usage.yaml").read_text())["components"]
WORKLOADS = {
    "controller": ("Deployment", "cd-controller"),
    "node-agent": ("DaemonSet", "cd-node-agent"),
    "placement-advisor": ("Deployment", "cd-placement-advisor"),
}
# Verbs that let a holder widen its own rights or act as someone else.
ESCALATING_VERBS = {"*", "escalate", "bind", "impersonate"}

Permission = tuple[str, str, str]  # (API group, resource, verb)


def usage_permissions(component: str) -> set[Permission]:
    return {(c["group"], c["resource"], verb) for c in USAGE[component]["calls"] for verb in c["verbs"]}


def granted_permissions(objects: list[Obj], service_account: str) -> set[Permission]:
    """Everything the (Cluster)RoleBindings in `objects` give `namespace/name`."""
    namespace, _, name = service_account.partition("/")
    roles = {
        (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r
        for r in objects
        if r["kind"] in ("Role", "ClusterRole")
    }
    granted: set[Permission] = set()
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = binding.get("subjects") or []
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == name and s.get("namespace") == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        role_namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles[(ref["kind"], role_namespace, ref["name"])]
        for rule in role.get("rules") or []:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        granted.add((group, resource, verb))
    return granted


def test_usage_file_names_every_component_and_its_service_account(base: list[Obj]) -> None:
    assert set(USAGE) == set(WORKLOADS)
    for component, entry in USAGE.items():
        namespace, _, name = entry["serviceAccount"].partition("/")
        assert namespace == NAMESPACE
        find(base, "ServiceAccount", name)
        for call in entry["calls"]:
            assert call["verbs"] and call.get("why"), f"{component}: {call}"


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_roles_grant_exactly_the_calls_in_the_usage_file(tree: tuple[str, list[Obj]], component: str) -> None:
    _, objects = tree
    service_account = USAGE[component]["serviceAccount"]
    assert granted_permissions(objects, service_account) == usage_permissions(component)


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_each_component_runs_as_its_own_service_account(tree: tuple[str, list[Obj]], component: str) -> None:
    _, objects = tree
    kind, name = WORKLOADS[component]
    spec = pod_spec(find(objects, kind, name))
    assert f"{NAMESPACE}/{spec['serviceAccountName']}" == USAGE[component]["serviceAccount"]


def test_no_wildcards_or_escalation_in_any_rule(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    for role in of_kind(objects, "ClusterRole") + of_kind(objects, "Role"):
        assert "aggregationRule" not in role, role["metadata"]["name"]
        for rule in role.get("rules") or []:
            where = f"{role['metadata']['name']}: {rule}"
            for field in ("apiGroups", "resources", "verbs"):
                assert all("*" not in value for value in rule.get(field) or []), where
            assert not set(rule["verbs"]) & ESCALATING_VERBS, where
            assert "nonResourceURLs" not in rule, where
            assert "secrets" not in rule.get("resources", []), where


def test_bindings_point_at_existing_roles_and_service_accounts(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    accounts = {
        (sa["metadata"]["namespace"], sa["metadata"]["name"]) for sa in of_kind(objects, "ServiceAccount")
    }
    roles = {
        (r["kind"], r["metadata"]["name"]) for r in of_kind(objects, "ClusterRole") + of_kind(objects, "Role")
    }
    bindings = of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding")
    assert bindings
    for binding in bindings:
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in roles
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount"
            assert (subject["namespace"], subject["name"]) in accounts


def test_no_lease_permissions_because_leader_election_uses_etcd(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    for component in WORKLOADS:
        granted = granted_permissions(objects, USAGE[component]["serviceAccount"])
        assert not any(group == "coordination.k8s.io" for group, _, _ in granted)


def test_etcd_gets_no_api_credentials(sim: list[Obj]) -> None:
    spec: dict[str, Any] = pod_spec(find(sim, "StatefulSet", "cd-etcd"))
    assert spec["automountServiceAccountToken"] is False
