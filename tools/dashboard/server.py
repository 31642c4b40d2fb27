"""The dashboard's HTTP routes: the page, its state as JSON, and the live event stream (SSE).

GET /            the page (inline CSS and JS, nothing fetched from elsewhere)
GET /api/state   the current document (see tools.dashboard.model.DashboardView.document)
GET /events      text/event-stream: an `event: state` with the whole document at once and
                 after every change (bursts coalesced), `: keepalive` comments when idle
GET /healthz, /readyz, /metrics   as every service (ready once all four watches listed)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aiohttp import web

from tools.dashboard.feed import DashboardFeed
from tools.dashboard.page import PAGE_HTML

log = structlog.get_logger(__name__)

# A burst of store events (a 18-node job forming) becomes one update per this many seconds.
COALESCE_S = 0.15
FEED_KEY = web.AppKey("dashboard_feed", DashboardFeed)
KEEPALIVE_KEY = web.AppKey("dashboard_keepalive_s", float)


async def _page(_: web.Request) -> web.Response:
    return web.Response(
        text=PAGE_HTML,
        content_type="text/html",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP},
    )


# Everything the page needs is inline or from this origin; nothing else may load.
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


async def _state(request: web.Request) -> web.Response:
    _, body = request.app[FEED_KEY].rendered()
    return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-cache"})


async def _events(request: web.Request) -> web.StreamResponse:
    feed = request.app[FEED_KEY]
    keepalive_s = request.app[KEEPALIVE_KEY]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    feed.metrics.clients.inc()
    sent = -1
    try:
        await response.write(b"retry: 1000\n\n")
        while not feed.closed:
            version, body = feed.rendered()
            if version != sent:
                await response.write(b"event: state\nid: %d\ndata: %s\n\n" % (version, body))
                feed.metrics.updates_sent.inc()
                sent = version
            if await feed.wait_newer(sent, keepalive_s):
                await asyncio.sleep(COALESCE_S)
            elif not feed.closed:
                await response.write(b": keepalive\n\n")
    except (ConnectionResetError, ConnectionError):
        pass  # the browser went away
    finally:
        feed.metrics.clients.dec()
    return response


def add_routes(feed: DashboardFeed, keepalive_s: float) -> Callable[[web.Application], None]:
    """`extra_routes` for `libs.runtime.health.build_health_app`."""

    def install(app: web.Application) -> None:
        app[FEED_KEY] = feed
        app[KEEPALIVE_KEY] = keepalive_s
        app.router.add_get("/", _page)
        app.router.add_get("/api/state", _state)
        app.router.add_get("/events", _events)

        async def release_clients(_: web.Application) -> None:
            feed.close()

        app.on_shutdown.append(release_clients)

    return install
