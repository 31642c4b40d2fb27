"""The admission policies narrow our cluster-wide write rights to what each component is for."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from services.nodeagent.wire.resourceslice import build_resource_slice
from tests.manifests.admission import AdmissionRequest, PolicyEvaluator
from tests.manifests.objects import NAMESPACE, Obj, find, of_kind

NODE_AGENT = "system:serviceaccount:compute-domains-system:cd-node-agent"
CONTROLLER = "system:serviceaccount:compute-domains-system:cd-controller"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
CLIQUE = "9277d399-0674-44a9-b64e-d85bb19ce2b0.32766"


def _evaluator(objects: list[Obj], name: str) -> PolicyEvaluator:
    # The policies take our Namespace as their parameter (the binding selects it by label).
    return PolicyEvaluator(
        find(objects, "ValidatingAdmissionPolicy", name), find(objects, "Namespace", NAMESPACE)
    )


@pytest.fixture(scope="module")
def slices_policy(rendered: dict[str, list[Obj]]) -> PolicyEvaluator:
    return _evaluator(rendered["base"], "computedomains-node-agent-resourceslices")


@pytest.fixture(scope="module")
def nodes_policy(rendered: dict[str, list[Obj]]) -> PolicyEvaluator:
    return _evaluator(rendered["base"], "computedomains-node-labels")


def agent_on(node: str) -> dict[str, Any]:
    return {"username": NODE_AGENT, "extra": {NODE_NAME_KEY: [node]}}


def slice_request(operation: str, who: dict[str, Any], new: Any = None, old: Any = None) -> AdmissionRequest:
    return AdmissionRequest(
        operation, "resource.k8s.io", "v1", "resourceslices", object=new, old_object=old, **who
    )


def test_every_policy_is_bound_to_deny(tree: tuple[str, list[Obj]]) -> None:
    _, objects = tree
    policies = {p["metadata"]["name"] for p in of_kind(objects, "ValidatingAdmissionPolicy")}
    bindings = of_kind(objects, "ValidatingAdmissionPolicyBinding")
    assert policies == {b["spec"]["policyName"] for b in bindings}
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)


def test_node_agent_may_publish_update_and_delete_its_own_slice(slices_policy: PolicyEvaluator) -> None:
    mine = build_resource_slice("rack0-tray0", CLIQUE)
    changed = build_resource_slice("rack0-tray0", "", generation=2)
    assert slices_policy.evaluate(slice_request("CREATE", agent_on("rack0-tray0"), new=mine)) == []
    assert (
        slices_policy.evaluate(slice_request("UPDATE", agent_on("rack0-tray0"), new=changed, old=mine)) == []
    )
    assert slices_policy.evaluate(slice_request("DELETE", agent_on("rack0-tray0"), old=mine)) == []


def test_node_agent_may_not_touch_another_nodes_slice(slices_policy: PolicyEvaluator) -> None:
    theirs = build_resource_slice("rack0-tray1", CLIQUE)
    for request in (
        slice_request("CREATE", agent_on("rack0-tray0"), new=theirs),
        slice_request("UPDATE", agent_on("rack0-tray0"), new=theirs, old=theirs),
        slice_request("DELETE", agent_on("rack0-tray0"), old=theirs),
    ):
        denials = slices_policy.evaluate(request)
        assert denials and "for its own node" in denials[0]


def test_node_agent_may_not_move_its_slice_to_another_node(slices_policy: PolicyEvaluator) -> None:
    mine = build_resource_slice("rack0-tray0", CLIQUE)
    hijacked = copy.deepcopy(mine)
    hijacked["spec"]["nodeName"] = "rack0-tray1"
    assert slices_policy.evaluate(slice_request("UPDATE", agent_on("rack0-tray1"), new=hijacked, old=mine))


def test_node_agent_may_not_write_another_drivers_slice(slices_policy: PolicyEvaluator) -> None:
    other = build_resource_slice("rack0-tray0", CLIQUE)
    other["spec"]["driver"] = "gpu.nvidia.com"
    assert slices_policy.evaluate(slice_request("CREATE", agent_on("rack0-tray0"), new=other))


def test_a_token_not_bound_to_a_node_is_refused(slices_policy: PolicyEvaluator) -> None:
    mine = build_resource_slice("rack0-tray0", CLIQUE)
    denials = slices_policy.evaluate(slice_request("CREATE", {"username": NODE_AGENT}, new=mine))
    assert denials and "not bound to a node" in denials[0]


def test_other_users_are_not_subject_to_our_policies(
    slices_policy: PolicyEvaluator, nodes_policy: PolicyEvaluator
) -> None:
    theirs = build_resource_slice("rack0-tray1", CLIQUE)
    other_driver = {
        "username": "system:serviceaccount:gpu-driver:kubelet-plugin",
        "extra": {NODE_NAME_KEY: ["x"]},
    }
    assert slices_policy.evaluate(slice_request("CREATE", other_driver, new=theirs)) is None
    node = {"metadata": {"name": "n", "labels": {}}, "spec": {}}
    relabelled = {"metadata": {"name": "n", "labels": {"any": "thing"}}, "spec": {}}
    request = AdmissionRequest(
        "UPDATE", "", "v1", "nodes", "system:node:n", object=relabelled, old_object=node
    )
    assert nodes_policy.evaluate(request) is None


NODE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": "rack0-tray0",
        "labels": {"kubernetes.io/hostname": "rack0-tray0", "nvidia.com/gpu.present": "true"},
        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
    },
    "spec": {"podCIDR": "10.244.1.0/24"},
}


def node_update(who: dict[str, Any], change: dict[str, Any], name: str = "rack0-tray0") -> AdmissionRequest:
    old = copy.deepcopy(NODE)
    old["metadata"]["name"] = name
    new = copy.deepcopy(old)
    for field, value in change.items():
        section, _, key = field.partition(".")
        if section == "labels":
            new["metadata"]["labels"][key] = value
        elif section == "annotations":
            new["metadata"]["annotations"][key] = value
        elif section == "finalizers":
            new["metadata"]["finalizers"] = [value]
        else:
            new["spec"][key] = value
    return AdmissionRequest("UPDATE", "", "v1", "nodes", object=new, old_object=old, **who)


def test_node_agent_may_set_the_clique_label_on_its_own_node(nodes_policy: PolicyEvaluator) -> None:
    assert (
        nodes_policy.evaluate(node_update(agent_on("rack0-tray0"), {"labels.nvidia.com/gpu.clique": CLIQUE}))
        == []
    )


@pytest.mark.parametrize(
    ("change", "name", "expected"),
    [
        ({"labels.nvidia.com/gpu.clique": CLIQUE}, "rack0-tray1", "only change its own Node"),
        (
            {"labels.node-role.kubernetes.io/control-plane": ""},
            "rack0-tray0",
            "only change the Node label nvidia.com/gpu.clique",
        ),
        ({"labels.kubernetes.io/hostname": "elsewhere"}, "rack0-tray0", "only change the Node label"),
        ({"annotations.x": "y"}, "rack0-tray0", "may not change Node annotations"),
        ({"spec.unschedulable": True}, "rack0-tray0", "may not change the Node spec"),
        ({"finalizers.x": "example.com/block"}, "rack0-tray0", "finalizers"),
    ],
    ids=["other-node", "add-label", "change-label", "annotation", "cordon", "finalizer"],
)
def test_node_agent_may_change_nothing_else_on_nodes(
    nodes_policy: PolicyEvaluator, change: dict[str, Any], name: str, expected: str
) -> None:
    denials = nodes_policy.evaluate(node_update(agent_on("rack0-tray0"), change, name=name))
    assert denials and any(expected in d for d in denials), denials


def test_controller_may_only_set_the_domain_label_on_any_node(nodes_policy: PolicyEvaluator) -> None:
    controller = {"username": CONTROLLER}
    label = "labels.resource.nvidia.com/computeDomain"
    assert nodes_policy.evaluate(node_update(controller, {label: "0b5e-uid"}, name="rack3-tray7")) == []
    assert nodes_policy.evaluate(node_update(controller, {"labels.nvidia.com/gpu.clique": CLIQUE}))
    assert nodes_policy.evaluate(node_update(controller, {"spec.unschedulable": True}))


def test_removing_the_allowed_label_is_allowed(nodes_policy: PolicyEvaluator) -> None:
    old = copy.deepcopy(NODE)
    old["metadata"]["labels"]["resource.nvidia.com/computeDomain"] = "0b5e-uid"
    new = copy.deepcopy(NODE)
    request = AdmissionRequest("UPDATE", "", "v1", "nodes", CONTROLLER, object=new, old_object=old)
    assert nodes_policy.evaluate(request) == []


def test_policies_follow_the_namespace_they_are_installed_in(tree: tuple[str, list[Obj]]) -> None:
    # A literal namespace in a policy would silently exempt our accounts once the tree is moved to
    # another namespace; the parameter (our labelled Namespace) moves with them.
    _, objects = tree
    [namespace] = of_kind(objects, "Namespace")
    for policy in of_kind(objects, "ValidatingAdmissionPolicy"):
        assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "Namespace"}
        assert NAMESPACE not in str(policy["spec"]), policy["metadata"]["name"]
    for binding in of_kind(objects, "ValidatingAdmissionPolicyBinding"):
        selector = binding["spec"]["paramRef"]["selector"]["matchLabels"]
        assert selector.items() <= namespace["metadata"]["labels"].items(), binding["metadata"]["name"]
