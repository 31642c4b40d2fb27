"""The ComputeDomain CRD: NVIDIA's names and schema, our additions, and what it accepts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.manifests.crdschema import CrdValidator, structural_problems
from tests.manifests.objects import Obj, find

EXAMPLES = Path(__file__).resolve().parent / "examples"
CRD_NAME = "computedomains.resource.nvidia.com"
IMMUTABLE = "A computeDomain.spec is immutable"


@pytest.fixture(scope="module")
def crd(rendered: dict[str, list[Obj]]) -> Obj:
    return find(rendered["base"], "CustomResourceDefinition", CRD_NAME)


@pytest.fixture(scope="module")
def validator(crd: Obj) -> CrdValidator:
    return CrdValidator(crd, "v1beta1")


@pytest.fixture(scope="module")
def schema(crd: Obj) -> dict[str, Any]:
    result: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def cd(spec: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "job-cd", "namespace": "team-a"},
        "spec": spec
        if spec is not None
        else {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "ch"}}},
    }
    obj.update(extra)
    return obj


def example_domains() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "ComputeDomain":
                found.append((path.name, doc))
    return found


def test_identity_matches_nvidias_api(crd: Obj) -> None:
    spec = crd["spec"]
    assert spec["group"] == "resource.nvidia.com"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "ComputeDomain",
        "listKind": "ComputeDomainList",
        "plural": "computedomains",
        "singular": "computedomain",
        "shortNames": ["cd"],
    }
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1beta1", True, True)
    assert version["subresources"] == {"status": {}}


def test_kubectl_get_shows_status_nodes_and_age(crd: Obj) -> None:
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    default_view = [(c["name"], c["jsonPath"]) for c in columns if c.get("priority", 0) == 0]
    assert default_view == [
        ("Status", ".status.status"),
        ("Nodes", ".status.nodeCount"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    assert {c["name"]: c["type"] for c in columns}["Age"] == "date"


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    assert structural_problems(schema) == []


def test_spec_fields_types_defaults_and_enums(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    assert "spec" in schema["required"]
    assert spec["required"] == ["channel"]
    num_nodes = spec["properties"]["numNodes"]
    assert (num_nodes["type"], num_nodes["minimum"], num_nodes["default"]) == ("integer", 0, 0)
    channel = spec["properties"]["channel"]
    assert channel["required"] == ["resourceClaimTemplate"]
    template = channel["properties"]["resourceClaimTemplate"]
    assert template["required"] == ["name"] and template["properties"]["name"]["type"] == "string"
    mode = channel["properties"]["allocationMode"]
    assert (mode["type"], set(mode["enum"]), mode["default"]) == ("string", {"Single", "All"}, "Single")


def test_whole_spec_is_immutable_with_nvidias_message(schema: dict[str, Any]) -> None:
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    assert {"rule": "self == oldSelf", "message": IMMUTABLE} in rules


def test_status_fields_match_nvidias(schema: dict[str, Any]) -> None:
    status = schema["properties"]["status"]["properties"]
    assert (status["status"]["enum"], status["status"]["default"]) == (["Ready", "NotReady"], "NotReady")
    nodes = status["nodes"]
    assert nodes["x-kubernetes-list-type"] == "map" and nodes["x-kubernetes-list-map-keys"] == ["name"]
    item = nodes["items"]["properties"]
    assert {k: v["type"] for k, v in item.items()} == {
        "name": "string",
        "ipAddress": "string",
        "cliqueID": "string",
        "index": "integer",
        "status": "string",
    }
    assert item["status"]["enum"] == ["Ready", "NotReady"]


def test_conditions_have_the_standard_kubernetes_shape(schema: dict[str, Any]) -> None:
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == [
        "type"
    ]
    item = conditions["items"]
    assert set(item["properties"]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


# --- what the API server would accept --------------------------------------------------------


def test_the_examples_folder_holds_nvidias_examples() -> None:
    names = {doc["metadata"]["name"] for _, doc in example_domains()}
    assert {"imex-channel-injection", "nvbandwidth-test-compute-domain"} <= names


@pytest.mark.parametrize(
    ("source", "domain"), example_domains(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_nvidia_documentation_examples_are_accepted_unchanged(
    validator: CrdValidator, source: str, domain: dict[str, Any]
) -> None:
    assert validator.validate(domain) == []
    defaulted = validator.default(domain)
    assert defaulted["spec"]["channel"]["allocationMode"] == "Single"
    assert defaulted["spec"]["numNodes"] == domain["spec"]["numNodes"]


def test_defaults_fill_num_nodes_and_allocation_mode(validator: CrdValidator) -> None:
    domain = cd({"channel": {"resourceClaimTemplate": {"name": "ch"}}})
    assert validator.validate(domain) == []
    assert validator.default(domain)["spec"] == {
        "numNodes": 0,
        "channel": {"resourceClaimTemplate": {"name": "ch"}, "allocationMode": "Single"},
    }


def test_all_channels_mode_is_accepted(validator: CrdValidator) -> None:
    domain = cd(
        {"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": "ch"}, "allocationMode": "All"}}
    )
    assert validator.validate(domain) == []


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"numNodes": -1, "channel": {"resourceClaimTemplate": {"name": "ch"}}}, "spec.numNodes"),
        ({"numNodes": 2}, "'channel' is a required property"),
        ({"channel": {}}, "'resourceClaimTemplate' is a required property"),
        ({"channel": {"resourceClaimTemplate": {}}}, "'name' is a required property"),
        (
            {"channel": {"resourceClaimTemplate": {"name": "Not_A_Name"}}},
            "spec.channel.resourceClaimTemplate.name",
        ),
        ({"channel": {"resourceClaimTemplate": {"name": "ch"}, "allocationMode": "Many"}}, "allocationMode"),
        ({"numnodes": 1, "channel": {"resourceClaimTemplate": {"name": "ch"}}}, "'numnodes' was unexpected"),
    ],
    ids=[
        "negative-numNodes",
        "no-channel",
        "no-template",
        "no-template-name",
        "bad-name",
        "bad-mode",
        "typo",
    ],
)
def test_malformed_domains_are_rejected(validator: CrdValidator, spec: dict[str, Any], expected: str) -> None:
    errors = validator.validate(cd(spec))
    assert errors and any(expected in e for e in errors), errors


def test_a_domain_without_spec_is_rejected(validator: CrdValidator) -> None:
    domain = cd()
    del domain["spec"]
    assert any("'spec' is a required property" in e for e in validator.validate(domain))


@pytest.mark.parametrize(
    "change",
    [
        {"numNodes": 3},
        {"channel": {"resourceClaimTemplate": {"name": "other"}}},
        {"channel": {"resourceClaimTemplate": {"name": "ch"}, "allocationMode": "All"}},
    ],
)
def test_any_spec_change_after_create_is_rejected(validator: CrdValidator, change: dict[str, Any]) -> None:
    old = cd({"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "ch"}}})
    new = copy.deepcopy(old)
    new["spec"].update(change)
    assert validator.validate(new, old=old) == [f"spec: Invalid value: {IMMUTABLE}"]


def test_spelling_out_a_default_is_not_a_spec_change(validator: CrdValidator) -> None:
    old = cd({"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "ch"}}})
    new = cd(
        {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "ch"}, "allocationMode": "Single"}}
    )
    assert validator.validate(new, old=old) == []


def _status(nodes: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"status": "NotReady", "nodes": nodes, "nodeCount": len(nodes), **extra}


FABRIC_NODE = {
    "name": "rack0-tray0",
    "ipAddress": "10.0.0.1",
    "cliqueID": "c0ffee00-0000-4000-8000-000000000001.1",
    "index": 0,
    "status": "Ready",
}
NON_FABRIC_NODE = {
    "name": "cpu-node",
    "ipAddress": "10.0.0.9",
    "cliqueID": "",
    "index": -1,
    "status": "NotReady",
}
CONDITION = {
    "type": "Ready",
    "status": "False",
    "reason": "WaitingForNodes",
    "message": "1 of 2 nodes joined",
    "lastTransitionTime": "2025-01-01T00:00:00Z",
    "observedGeneration": 1,
}


def test_a_realistic_status_is_accepted(validator: CrdValidator) -> None:
    domain = cd(status=_status([FABRIC_NODE, NON_FABRIC_NODE], conditions=[CONDITION]))
    assert validator.validate(domain, old=cd()) == []


def test_node_status_defaults_to_not_ready(validator: CrdValidator) -> None:
    node = {k: v for k, v in FABRIC_NODE.items() if k != "status"}
    defaulted = validator.default(cd(status={"nodes": [node]}))
    assert defaulted["status"]["status"] == "NotReady"
    assert defaulted["status"]["nodes"][0]["status"] == "NotReady"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (_status([FABRIC_NODE, FABRIC_NODE]), "Duplicate value"),
        ({**_status([FABRIC_NODE]), "nodeCount": 2}, "status.nodeCount must equal"),
        (_status([{**FABRIC_NODE, "index": -2}]), "status.nodes.0.index"),
        (_status([{**FABRIC_NODE, "status": "Joining"}]), "status.nodes.0.status"),
        (_status([{"name": "n"}]), "'ipAddress' is a required property"),
        ({**_status([]), "status": "Degraded"}, "status.status"),
        (
            _status([], conditions=[{**CONDITION, "reason": "waiting for nodes"}]),
            "status.conditions.0.reason",
        ),
        (_status([], conditions=[CONDITION, CONDITION]), "Duplicate value"),
    ],
    ids=[
        "duplicate-node",
        "wrong-count",
        "index-below-minus-one",
        "bad-node-status",
        "missing-address",
        "bad-status",
        "bad-reason",
        "duplicate-condition",
    ],
)
def test_malformed_status_is_rejected(validator: CrdValidator, status: dict[str, Any], expected: str) -> None:
    errors = validator.validate(cd(status=status), old=cd())
    assert errors and any(expected in e for e in errors), errors
