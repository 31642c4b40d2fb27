"""Keeps a `DashboardView` current from store watches and tells waiting clients when it changed."""

from __future__ import annotations

import asyncio
import json

import structlog

from libs.state.store import Store
from libs.state.watch import Resync, watch_prefix
from tools.dashboard.metrics import DashboardMetrics
from tools.dashboard.model import RESOURCE_TYPES, RESOURCES, DashboardView, Resource

log = structlog.get_logger(__name__)


class DashboardFeed:
    """One watch per resource (domains, members, daemons, nodes) applied to one view.

    Clients wait with `wait_newer(version)`; the rendered JSON is computed once per version and
    shared by every client.
    """

    def __init__(self, store: Store, view: DashboardView, metrics: DashboardMetrics | None = None) -> None:
        self.store = store
        self.view = view
        self.metrics = metrics or DashboardMetrics()
        self.closed = False
        self._changed = asyncio.Event()
        self._rendered: tuple[int, bytes] = (-1, b"")

    def _prefix(self, resource: Resource) -> str:
        keys = self.store.keys
        return {
            "domains": keys.domains(),
            "members": keys.all_members(),
            "daemons": keys.all_daemons(),
            "nodes": keys.nodes(),
        }[resource]

    def _notify(self) -> None:
        # Wake everyone waiting now; later waiters get a fresh event.
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def follow(self, resource: Resource) -> None:
        """Apply one resource's watch to the view, forever (cancel to stop)."""
        watch = watch_prefix(self.store, self._prefix(resource), RESOURCE_TYPES[resource])
        async for item in watch:
            if isinstance(item, Resync):
                self.view.resync(resource, [(v.key, v.value) for v in item.items])
                log.info("dashboard view listed", resource=resource, items=len(item.items))
            else:
                self.view.apply(resource, item.key, item.value)
            self.metrics.store_events.labels(resource).inc()
            self._notify()

    def start(self) -> list[asyncio.Task[None]]:
        """One task per resource. Separate tasks, not a TaskGroup, so that stopping can cancel
        each watch again if a library swallowed the first cancellation."""
        return [
            asyncio.create_task(self.follow(resource), name=f"dashboard-watch-{resource}")
            for resource in RESOURCES
        ]

    def close(self) -> None:
        """Release every waiting client (the server is shutting down)."""
        self.closed = True
        self._notify()

    async def wait_newer(self, version: int, timeout_s: float) -> bool:
        """True once the view is newer than `version`; False on timeout or close.

        Returns at once, without suspending, when it already is newer or the feed is closed:
        loops around it must check `closed`.
        """
        while self.view.version <= version and not self.closed:
            event = self._changed
            try:
                async with asyncio.timeout(timeout_s):
                    await event.wait()
            except TimeoutError:
                return False
        return self.view.version > version

    def rendered(self) -> tuple[int, bytes]:
        """(version, the view's document as compact JSON), cached per version."""
        version = self.view.version
        if self._rendered[0] != version:
            body = json.dumps(self.view.document(), separators=(",", ":")).encode()
            self._rendered = (version, body)
        return self._rendered
