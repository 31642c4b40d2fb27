"""Prepared-claim records of lost nodes whose ResourceClaims are gone from the API server.

A lost member keeps its index while its node holds claims of the domain. The
kubelet plugin of a node lost for good never unprepares, so its records would hold the
index forever, even after Kubernetes deleted the node's pods (out-of-service taint, pod
garbage collection) and with them their claims. The leader checks the claims of the lost
members (`membership.lost_holdings`) with a fresh GET: a claim that is gone (not found, a
new uid under its name, or no longer allocated to that node) has its record deleted in one
transaction fenced on leadership, on the record's mod revision and on the node record's
absence. The membership logic then releases the lost member (`lost_member_releases`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from libs.gen.computedomain.state import v1 as pb
from libs.kube.resource_api import ServedVersion, typed_api
from libs.state.election import Leadership
from libs.state.store import Absent, Delete, Store, Unchanged
from services.controller.liveness import liveness
from services.controller.membership_decisions import lost_holdings
from services.controller.view import StoreView

log = structlog.get_logger(__name__)

_CALL_TIMEOUT_S = 30.0
# How often the leader looks at the claims of lost members (no API call while none is lost).
CHECK_INTERVAL_S = 10.0
_NODE_NAME_FIELD = "metadata.name"


def allocated_nodes(claim: Mapping[str, Any]) -> frozenset[str] | None:
    """Nodes the claim's allocation names by `metadata.name`; None if it names none that way."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    names: set[str] = set()
    named = False
    for term in selector.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == _NODE_NAME_FIELD and field.get("operator") == "In":
                named = True
                names.update(field.get("values") or [])
    return frozenset(names) if named else None


def claim_gone(claim_uid: str, node: str, claim: Mapping[str, Any] | None) -> str | None:
    """Why the claim prepared as `claim_uid` on `node` is gone from the API server, or None.

    `claim` is the object now under the prepared claim's namespace and name (None: not found).
    An allocation that names nodes some other way than by name counts as still held.
    """
    if claim is None:
        return "claim deleted"
    if (claim.get("metadata") or {}).get("uid") != claim_uid:
        return "claim replaced (another uid under its name)"
    if not (claim.get("status") or {}).get("allocation"):
        return "claim no longer allocated"
    nodes = allocated_nodes(claim)
    if nodes is not None and node not in nodes:
        return "claim allocated to another node"
    return None


async def read_claim(api: ApiClient, version: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The claim as the API server has it now (a quorum read, not a cache), None if not found."""
    try:
        obj = await typed_api(api, version).read_namespaced_resource_claim(
            name, namespace, _request_timeout=_CALL_TIMEOUT_S
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    serialized: dict[str, Any] = api.sanitize_for_serialization(obj)
    return serialized


def _lost_holdings(view: StoreView, uid: str) -> list[tuple[str, str]]:
    obs = view.observe(uid)
    return lost_holdings(obs, liveness(obs))


async def drop_vanished_claims(
    store: Store, view: StoreView, api: ApiClient, served: ServedVersion, leadership: Leadership
) -> int:
    """Delete the records of lost members' claims that are gone from the API server; how many."""
    dropped = 0
    held = [(uid, holding) for uid in sorted(view.domains) for holding in _lost_holdings(view, uid)]
    if not held:
        return 0
    version = await served.get()
    for uid, (node, claim_uid) in held:
        key = store.keys.preparation(node, claim_uid)
        record = await store.get(key, pb.PreparedClaim, strict=True)
        if record is None or record.value.domain_uid != uid:
            continue
        prepared = record.value
        if not prepared.namespace or not prepared.name:
            log.warning(
                "prepared claim of a lost node names no claim; kept",
                cd_uid=uid,
                node=node,
                claim_uid=claim_uid,
            )
            continue
        why = claim_gone(claim_uid, node, await read_claim(api, version, prepared.namespace, prepared.name))
        if why is None:
            continue
        result = await store.txn(
            [leadership.fence, Absent(store.keys.node(node)), Unchanged(key, record.mod_revision)],
            [Delete(key)],
        )
        if result.succeeded:
            dropped += 1
            log.info(
                "dropped prepared claim of a lost node: its claim is gone from the API server",
                cd_uid=uid,
                node=node,
                claim_uid=claim_uid,
                namespace=prepared.namespace,
                claim=prepared.name,
                why=why,
            )
    return dropped
