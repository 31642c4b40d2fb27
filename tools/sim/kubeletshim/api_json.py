"""API server reads and watches as plain JSON (no client model classes in between).

The generated model classes drop fields they do not know and cost a lot of CPU to build; the
shim reads pods and claims exactly as the API server sends them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

# Transport failures worth a retry (ApiException carries HTTP errors).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, OSError, TimeoutError)


async def read_json(call: Awaitable[Any]) -> Any:
    """Await a client call made with ``_preload_content=False``; its decoded body, ApiException on non-2xx."""
    response = await call
    try:
        status = int(response.status)
        body = await response.read()
    finally:
        response.release()
    if not 200 <= status <= 299:
        reason = body.decode(errors="replace")[:500]
        try:
            reason = str(json.loads(body).get("message", reason))
        except (ValueError, AttributeError):
            pass
        raise ApiException(status=status, reason=reason)
    return json.loads(body) if body else None


async def watch_events(call: Awaitable[Any]) -> AsyncIterator[dict[str, Any]]:
    """Events of a watch request (made with ``watch=True, _preload_content=False``) until the server ends it.

    An ERROR event is raised as ApiException with its code (410 = the resourceVersion is too old).
    """
    response = await call
    try:
        if not 200 <= int(response.status) <= 299:
            body = await response.read()
            raise ApiException(status=int(response.status), reason=body.decode(errors="replace")[:500])
        while True:
            line = await response.content.readline()
            if not line:
                return
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "ERROR":
                obj = event.get("object") or {}
                raise ApiException(status=int(obj.get("code") or 500), reason=str(obj.get("message", "")))
            yield event
    finally:
        response.release()
