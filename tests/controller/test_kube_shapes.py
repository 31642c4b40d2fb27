"""Pure parts of the Kubernetes adapter: RCT body, CR <-> store mapping, events, sweep selection."""

from __future__ import annotations

import pytest

from libs.gen.computedomain.state import v1 as pb
from services.controller.kube.computedomain import (
    FINALIZER,
    InvalidComputeDomain,
    StatusEcho,
    cr_status,
    cr_status_differs,
    domain_from_cr,
    finalizers_patch,
    seen_status,
    spec_from_cr,
    status_transition,
)
from services.controller.kube.events import transition_events
from services.controller.kube.resourceclaimtemplate import build_rct, owner_uid
from services.controller.kube.sweep import Labelled, leftovers
from services.controller.status_model import ConditionEntry, NodeEntry, StatusValue

UID = "6f1c7d2e-0000-4000-8000-000000000001"


def cr(spec: dict, **meta) -> dict:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {
            "name": "job-cd",
            "namespace": "team-a",
            "uid": UID,
            "resourceVersion": "41",
            "creationTimestamp": "2026-01-02T03:04:05Z",
            **meta,
        },
        "spec": spec,
    }


def test_rct_has_the_exact_upstream_shape() -> None:
    assert build_rct(UID, "team-a", "job-channel", "All") == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": "job-channel",
            "namespace": "team-a",
            # The target label is how NVIDIA's controller finds its workload templates (rollback).
            "labels": {
                "resource.nvidia.com/computeDomain": UID,
                "resource.nvidia.com/computeDomainTarget": "Workload",
            },
            "finalizers": ["resource.nvidia.com/computeDomain"],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "channel",
                            "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"},
                        }
                    ],
                    "config": [
                        {
                            "requests": ["channel"],
                            "opaque": {
                                "driver": "compute-domain.nvidia.com",
                                "parameters": {
                                    "apiVersion": "resource.nvidia.com/v1beta1",
                                    "kind": "ComputeDomainChannelConfig",
                                    "domainID": UID,
                                    "allocationMode": "All",
                                },
                            },
                        }
                    ],
                }
            }
        },
    }
    assert owner_uid(build_rct(UID, "ns", "x", "Single")) == UID
    with pytest.raises(ValueError, match="allocation mode"):
        build_rct(UID, "ns", "x", "Some")


def test_cr_maps_to_store_domain_with_defaults() -> None:
    d = domain_from_cr(cr({"channel": {"resourceClaimTemplate": {"name": "ch"}}}))
    assert (d.uid, d.namespace, d.name, d.source) == (UID, "team-a", "job-cd", "kubernetes")
    assert d.spec.num_nodes == 0
    assert d.spec.channel.resource_claim_template_name == "ch"
    assert d.spec.channel.allocation_mode == pb.AllocationMode.SINGLE
    assert d.created_unix_ms == 1767323045000
    full = spec_from_cr(
        cr({"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": "c"}, "allocationMode": "All"}})
    )
    assert full.num_nodes == 4 and full.channel.allocation_mode == pb.AllocationMode.ALL


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"numNodes": -1, "channel": {"resourceClaimTemplate": {"name": "c"}}}, "numNodes"),
        ({"numNodes": "2", "channel": {"resourceClaimTemplate": {"name": "c"}}}, "numNodes"),
        ({"channel": {}}, "resourceClaimTemplate.name"),
        ({"channel": {"resourceClaimTemplate": {"name": "c"}, "allocationMode": "Many"}}, "allocationMode"),
    ],
)
def test_invalid_spec_is_refused_naming_the_field(spec: dict, problem: str) -> None:
    with pytest.raises(InvalidComputeDomain, match=problem):
        spec_from_cr(cr(spec))


def test_store_status_maps_to_cr_status_fields() -> None:
    status = StatusValue(
        ready=True,
        nodes=(NodeEntry("n1", "10.0.0.1", "uuid.1", 0, True), NodeEntry("cpu", "10.0.0.9", "", -1, False)),
        conditions=(ConditionEntry("Ready", "True", "AllNodesReady", "2 of 2", 1767323045000),),
    )
    assert cr_status(status) == {
        "status": "Ready",
        "nodeCount": 2,
        "nodes": [
            {"name": "n1", "ipAddress": "10.0.0.1", "cliqueID": "uuid.1", "index": 0, "status": "Ready"},
            {"name": "cpu", "ipAddress": "10.0.0.9", "cliqueID": "", "index": -1, "status": "NotReady"},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllNodesReady",
                "message": "2 of 2",
                "lastTransitionTime": "2026-01-02T03:04:05Z",
            }
        ],
    }
    written = cr_status(status)
    assert not cr_status_differs(written, cr_status(status))
    assert cr_status_differs(None, written)
    assert cr_status_differs({**written, "status": "NotReady"}, written)


def test_only_a_transition_skips_the_status_write_pacing() -> None:
    """The node list and messages change on every join of a formation: those rewrites are paced;
    Ready, a condition's status or reason, and the mesh mode are written at once."""
    waiting = _status(False, "WaitingForNodes", "1 of 2")
    more = {**_status(False, "WaitingForNodes", "2 of 2"), "nodes": [{"name": "n1"}], "nodeCount": 1}
    assert cr_status_differs(waiting, more) and not status_transition(waiting, more)
    assert status_transition(None, waiting)
    assert status_transition(waiting, _status(True, "AllNodesReady", "2 of 2"))
    assert status_transition(waiting, _status(False, "ImexDaemonFailed", "n1: exited"))
    assert status_transition(waiting, {**waiting, "imexMesh": "tls"})


def test_a_status_pruned_by_an_older_crd_reads_as_written_until_someone_changes_it() -> None:
    """NVIDIA's CRD declares only status.status and status.nodes: the server drops the rest of a
    write, and the CR's status must not read as different on every pass (a PATCH and an Event
    each time)."""
    desired = {
        **_status(True, "AllNodesReady", "2 of 2"),
        "nodeCount": 2,
        "nodes": [{"name": "n1"}, {"name": "n2"}],
    }
    kept = {"status": "Ready", "nodes": [{"name": "n1"}, {"name": "n2"}]}
    echo = StatusEcho(sent=desired, kept=kept)
    assert cr_status_differs(kept, desired)  # what the comparison saw before
    assert seen_status(kept, echo) == desired
    assert not cr_status_differs(seen_status(kept, echo), desired)
    assert transition_events(seen_status(kept, echo), desired) == []
    # Someone else edited the status since: it is compared as it is, and written again.
    edited = {**kept, "status": "NotReady"}
    assert seen_status(edited, echo) == edited
    assert cr_status_differs(seen_status(edited, echo), desired)
    # No write yet (a fresh controller): the CR's own status.
    assert seen_status(kept, None) == kept


def test_finalizer_patch_adds_and_removes_only_ours_guarded_by_resource_version() -> None:
    obj = cr({}, finalizers=["other.io/keep"])
    add = finalizers_patch(obj, present=True)
    assert add[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "41"}
    assert add[1]["value"] == ["other.io/keep", FINALIZER]
    obj["metadata"]["finalizers"] = ["other.io/keep", FINALIZER]
    assert finalizers_patch(obj, present=False)[1]["value"] == ["other.io/keep"]


def _status(ready: bool, reason: str, message: str = "") -> dict:
    return {
        "status": "Ready" if ready else "NotReady",
        "conditions": [{"type": "Ready", "status": str(ready), "reason": reason, "message": message}],
    }


def test_events_on_transitions_only() -> None:
    waiting = _status(False, "WaitingForNodes", "0 of 2")
    ready = _status(True, "AllNodesReady", "2 of 2 node(s) ready")
    lost = _status(False, "NodeLost", "node(s) lost (agent lease expired): n3")
    assert [(e.type, e.reason) for e in transition_events(None, waiting)] == [("Normal", "NotReady")]
    assert transition_events(waiting, _status(False, "WaitingForNodes", "1 of 2")) == []
    assert [(e.type, e.reason) for e in transition_events(waiting, ready)] == [("Normal", "Ready")]
    assert transition_events(ready, ready) == []
    events = transition_events(ready, lost)
    assert [(e.type, e.reason) for e in events] == [("Warning", "NodeLost")] and "n3" in events[0].message
    assert transition_events(lost, lost) == []
    failed = transition_events(ready, _status(False, "ImexDaemonFailed", "n1: exited"))
    assert [(e.type, e.reason) for e in failed] == [("Warning", "NotReady")] and "ImexDaemonFailed" in failed[
        0
    ].message


def test_sweep_selects_only_objects_of_dead_domains() -> None:
    objs = [
        Labelled("ResourceClaimTemplate", "a", "live", "u1"),
        Labelled("ResourceClaimTemplate", "a", "dead", "u2"),
        Labelled("Node", "", "n1", "u2"),
        Labelled("Node", "", "n2", ""),
    ]
    assert [o.name for o in leftovers(objs, {"u1"})] == ["dead", "n1"]
