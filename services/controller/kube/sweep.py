"""The periodic sweep of objects left behind by ComputeDomains that no longer exist.

ResourceClaimTemplates and node labels carry `resource.nvidia.com/computeDomain=<uid>`.
If that uid belongs to no CR and no store domain (teardown finished, or a
controller crashed between steps) they are removed. Objects are listed
before the live uids, so an object made for a CD created meanwhile is never
taken for a leftover.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from libs.kube.resource_api import typed_api
from services.controller.kube.computedomain import LABEL_KEY
from services.controller.kube.node_label import unlabel_node
from services.controller.kube.resourceclaimtemplate import remove_template

log = structlog.get_logger(__name__)

_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Labelled:
    kind: str  # "ResourceClaimTemplate" | "Node"
    namespace: str  # "" for cluster-scoped
    name: str
    cd_uid: str


def leftovers(objects: Iterable[Labelled], live_uids: set[str]) -> list[Labelled]:
    return [o for o in objects if o.cd_uid and o.cd_uid not in live_uids]


@dataclass
class SweepResult:
    templates_removed: int = 0
    node_labels_removed: int = 0


async def list_labelled(api: ApiClient, version: str = "v1") -> list[Labelled]:
    resource = typed_api(api, version)
    core = CoreV1Api(api)
    out: list[Labelled] = []
    rcts = await resource.list_resource_claim_template_for_all_namespaces(
        label_selector=LABEL_KEY, _request_timeout=_CALL_TIMEOUT_S
    )
    for item in rcts.items:
        labels = item.metadata.labels or {}
        out.append(
            Labelled(
                "ResourceClaimTemplate",
                item.metadata.namespace,
                item.metadata.name,
                labels.get(LABEL_KEY, ""),
            )
        )
    nodes = await core.list_node(label_selector=LABEL_KEY, _request_timeout=_CALL_TIMEOUT_S)
    for node in nodes.items:
        labels = node.metadata.labels or {}
        out.append(Labelled("Node", "", node.metadata.name, labels.get(LABEL_KEY, "")))
    return out


async def sweep_once(
    api: ApiClient, objects: list[Labelled], live_uids: set[str], version: str = "v1"
) -> SweepResult:
    """Remove the `objects` (listed before `live_uids` was taken) whose CD is gone."""
    result = SweepResult()
    for obj in leftovers(objects, live_uids):
        try:
            if obj.kind == "ResourceClaimTemplate":
                await remove_template(api, obj.namespace, obj.name, version=version)
                result.templates_removed += 1
            else:
                await unlabel_node(api, obj.name, obj.cd_uid)
                result.node_labels_removed += 1
            log.info(
                "swept leftover", kind=obj.kind, namespace=obj.namespace, name=obj.name, cd_uid=obj.cd_uid
            )
        except (ApiException, OSError, TimeoutError) as exc:
            log.warning(
                "sweep failed for object", kind=obj.kind, name=obj.name, cd_uid=obj.cd_uid, error=str(exc)
            )
    return result
