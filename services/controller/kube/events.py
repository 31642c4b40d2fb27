"""Kubernetes Events on ComputeDomain transitions: which to emit (pure) and emitting them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from services.controller.cd_status import REASON_NODE_LOST
from services.controller.kube.computedomain import object_ref

log = structlog.get_logger(__name__)

COMPONENT = "compute-domain-controller"
# Deadline of one Events API call.
_EVENT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


def _ready_condition(status: dict[str, Any] | None) -> dict[str, Any] | None:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return dict(cond)
    return None


def transition_events(before: dict[str, Any] | None, after: dict[str, Any]) -> list[EventSpec]:
    """Events for a change of a CD's status from `before` to `after` (CR status dicts).

    Ready: the domain became Ready. NotReady: it left Ready, or its reason
    changed while not Ready (with that reason). NodeLost: a warning naming the
    lost node(s), whenever the NodeLost message changes.
    """
    old, new = _ready_condition(before), _ready_condition(after)
    if new is None:
        return []
    old_status = old.get("status") if old else None
    old_reason = old.get("reason") if old else None
    out: list[EventSpec] = []
    if new.get("status") == "True":
        if old_status != "True":
            out.append(EventSpec("Normal", "Ready", new.get("message") or "all nodes ready"))
        return out
    reason = new.get("reason", "")
    if reason == REASON_NODE_LOST:
        if old_reason != REASON_NODE_LOST or (old and old.get("message") != new.get("message")):
            out.append(EventSpec("Warning", REASON_NODE_LOST, new.get("message", "")))
        return out
    if old_status == "True" or old_reason != reason:
        kind = "Warning" if old_status == "True" or reason == "ImexDaemonFailed" else "Normal"
        out.append(EventSpec(kind, "NotReady", f"{reason}: {new.get('message', '')}"))
    return out


def event_body(cr: dict[str, Any], event: EventSpec, instance: str) -> dict[str, Any]:
    now = datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = cr["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
        "involvedObject": object_ref(cr),
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    def __init__(self, api: ApiClient, instance: str) -> None:
        self.core = CoreV1Api(api)
        self.instance = instance

    async def emit(self, cr: dict[str, Any], event: EventSpec) -> None:
        """Best effort: a failed event is logged, never fails the reconcile."""
        meta = cr["metadata"]
        try:
            await self.core.create_namespaced_event(
                meta["namespace"],
                cast(
                    Any, event_body(cr, event, self.instance)
                ),  # the client serialises plain dicts as they are
                _request_timeout=_EVENT_TIMEOUT_S,
            )
        except (ApiException, OSError, TimeoutError) as exc:
            log.warning(
                "event not recorded",
                cd=meta["name"],
                namespace=meta["namespace"],
                reason=event.reason,
                error=str(exc),
            )
