"""libs/kube/client.py: API clients that look nothing up in the environment per request, yet still
go through the proxy the environment names, resolved once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp.client
import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from libs.kube.client import without_env_lookups


@pytest.fixture
async def api_server() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server answering GET /api with JSON; the paths it was asked for."""
    seen: list[str] = []

    async def api(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        return web.json_response({"kind": "APIVersions", "versions": ["v1"]})

    app = web.Application()
    app.router.add_get("/api", api)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


async def _get(api: Any) -> int:
    response = await api.call_api(
        "/api",
        "GET",
        header_params={"Accept": "application/json"},
        _preload_content=False,
        _request_timeout=5,
    )
    response = response[0] if isinstance(response, tuple) else response
    try:
        return int(response.status)
    finally:
        response.release()


async def test_requests_make_no_environment_lookups(
    api_server: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    host, seen = api_server
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    lookups: list[str] = []
    real_proxy_lookup = aiohttp.client.get_env_proxy_for_url

    def proxy_lookup(url: Any) -> Any:
        lookups.append(f"proxy {url}")
        return real_proxy_lookup(url)

    def netrc_lookup(self: Any, host: str) -> None:
        lookups.append(f"netrc {host}")

    monkeypatch.setattr(aiohttp.client, "get_env_proxy_for_url", proxy_lookup)
    monkeypatch.setattr(aiohttp.ClientSession, "_get_netrc_auth", netrc_lookup)

    # kubernetes-asyncio's own client looks up .netrc and the proxy variables for every request.
    plain = ApiClient(Configuration(host=host))
    try:
        assert await _get(plain) == 200
    finally:
        await plain.close()
    assert len(lookups) == 2, lookups

    lookups.clear()
    api = await without_env_lookups(ApiClient(Configuration(host=host)))
    try:
        for _ in range(3):
            assert await _get(api) == 200
        assert api.rest_client.pool_manager.trust_env is False
    finally:
        await api.close()
    assert lookups == []
    assert seen == ["/api"] * 4


async def test_a_proxy_named_by_the_environment_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://user:secret@proxy.example:3128")
    api = await without_env_lookups(ApiClient(Configuration(host="http://apiserver.example:6443")))
    try:
        assert api.rest_client.proxy == "http://proxy.example:3128"
        assert api.rest_client.proxy_headers["Proxy-Authorization"].startswith("Basic ")
    finally:
        await api.close()

    # A host the environment exempts goes direct; a proxy the configuration names stays.
    monkeypatch.setenv("NO_PROXY", "apiserver.example")
    direct = await without_env_lookups(ApiClient(Configuration(host="http://apiserver.example:6443")))
    configured = Configuration(host="http://apiserver.example:6443")
    configured.proxy = "http://configured.example:8080"
    kept = await without_env_lookups(ApiClient(configured))
    try:
        assert direct.rest_client.proxy is None
        assert kept.rest_client.proxy == "http://configured.example:8080"
    finally:
        await direct.close()
        await kept.close()
