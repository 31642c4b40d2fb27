"""kubernetes-asyncio clients without the environment lookups aiohttp makes on every request.

kubernetes-asyncio opens its aiohttp session with ``trust_env=True``. aiohttp then looks up
``~/.netrc`` (in the default executor) and the proxy variables (in a thread of its own) for every
request: two hand-offs to worker threads and back per API call, about 0.5 ms of the event loop's
CPU per claim read on the benchmark machine, more than the read itself costs, and a wait behind
whatever else holds those threads. client-go reads the proxy variables once per process and
never reads ``.netrc``; :func:`without_env_lookups` does the same: it resolves the proxy for the
API server once, at start, and gives the client a session that looks up nothing per request
(same TLS settings, connection limit and read buffer as kubernetes-asyncio's own).
"""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

# kubernetes-asyncio's read buffer: watch events of large objects exceed aiohttp's default.
_READ_BUFSIZE = 2**21


def _ssl_context(configuration: Any) -> ssl.SSLContext:
    """The TLS settings kubernetes-asyncio's REST client derives from its configuration."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.disable_strict_ssl_verification:
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


async def without_env_lookups(api: Any) -> Any:
    """`api` (a kubernetes-asyncio ``ApiClient``) with a session that makes no per-request
    environment lookups; a proxy the environment names for the API server is resolved now."""
    configuration = api.configuration
    rest = api.rest_client
    if not rest.proxy:
        try:
            proxy, proxy_auth = get_env_proxy_for_url(URL(configuration.host))
        except LookupError:
            pass  # no proxy for the API server: the usual case in a cluster
        else:
            rest.proxy = str(proxy)
            if proxy_auth is not None:
                rest.proxy_headers = {
                    **(rest.proxy_headers or {}),
                    "Proxy-Authorization": proxy_auth.encode(),
                }
    previous = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=configuration.connection_pool_maxsize, ssl=_ssl_context(configuration)
        ),
        trust_env=False,
        read_bufsize=_READ_BUFSIZE,
    )
    await previous.close()
    return api
