"""Hostile input at the advisor's kube-scheduler extender (HTTP), against a real advisor process.

After each input: the advisor is healthy (/healthz, and a valid filter still answers), the refusal
is a clear 4xx naming the field or limit (never a 500), a reservation made first over gRPC is still
held, and the advisor's RSS stays under RSS_BOUND_MB.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from grpclib.client import Channel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.gen.computedomain.placement import v1 as pp
from tests.hostile.advisor_process import (
    IDLE_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    RSS_BOUND_MB,
    AdvisorProcess,
    raw_connection_closed_within,
    rss_mb,
)

HOLDER = "hostile-extender-suite"
# A 400's message starts with the part of ExtenderArgs it refuses.
_NAMED = ("request body", "Pod", "NodeNames", "Nodes")
VALID = {"Pod": {"metadata": {"name": "p", "namespace": "default"}}, "NodeNames": ["a", "b"]}


@pytest.fixture
async def http(advisor_process: AdvisorProcess) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session, with a reservation of 2 nodes made over gRPC before the hostile input."""
    channel = Channel("127.0.0.1", advisor_process.grpc_port)
    stub = pp.PlacementAdvisorStub(channel, timeout=10.0)
    reply = await stub.place(
        pp.PlaceRequest(num_nodes=2, reserve=True, holder=HOLDER, reservation_ttl_seconds=300)
    )
    assert reply.feasible
    try:
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{advisor_process.extender_port}", timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            yield session
        capacity = await stub.get_capacity(pp.GetCapacityRequest())
        assert capacity.reserved_nodes >= 2, "the reservation made before the hostile input is gone"
    finally:
        await stub.release(pp.ReleaseRequest(reservation_id=reply.reservation_id, holder=HOLDER))
        channel.close()


async def _post(http: aiohttp.ClientSession, body: bytes, verb: str = "filter") -> tuple[int, str]:
    async with http.post(f"/{verb}", data=body, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.text()


def _error(status: int, text: str) -> str:
    """The refusal's message: a 4xx body is JSON, {"Error": message}."""
    assert 400 <= status < 500, f"{status}: {text[:300]}"
    message = json.loads(text)["Error"]
    assert isinstance(message, str) and len(message) < 1024, text[:300]
    return message


async def _still_fine(advisor: AdvisorProcess, http: aiohttp.ClientSession) -> None:
    await advisor.healthy()
    status, text = await _post(http, orjson.dumps(VALID))
    assert status == 200 and json.loads(text)["NodeNames"] == ["a", "b"], text
    assert rss_mb(advisor.pid) < RSS_BOUND_MB, f"advisor RSS {rss_mb(advisor.pid):.0f} MB"
    advisor.assert_clean_log()


async def test_a_50_mb_body_is_413_naming_the_limit_and_memory_stays_bounded(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession
) -> None:
    nodes = [f"n{i:07d}" for i in range(50 * 1024 * 1024 // 11)]
    body = orjson.dumps({"Pod": VALID["Pod"], "NodeNames": nodes})
    assert len(body) > 50 * 1000 * 1000
    before = rss_mb(advisor_process.pid)
    answered = 0
    for verb in ("filter", "prioritize", "filter"):
        try:
            status, text = await _post(http, body, verb)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            continue  # the server may close before the client has sent it all
        answered += 1
        assert status == 413, text[:300]
        message = _error(status, text)
        assert str(MAX_BODY_BYTES) in message and "extender-max-body-bytes" in message, message
    assert answered, "no 50 MB request got an answer"
    await _still_fine(advisor_process, http)
    print(f"advisor RSS before the 50 MB bodies {before:.0f} MB, after {rss_mb(advisor_process.pid):.0f} MB")


async def test_json_nested_100000_deep_is_400_naming_the_depth_limit(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession
) -> None:
    for body in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"Pod":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001,
        b'{"Pod": {"metadata": {"name": "p"}, "spec": ' + b"[" * 2000 + b"]" * 2000 + b"}}",
    ):
        status, text = await _post(http, body)
        assert status == 400, text[:300]
        assert "nested deeper than 1024 levels" in _error(status, text), text[:300]
    await _still_fine(advisor_process, http)


@pytest.mark.parametrize("template", [42, 4.5, True, ["t"], {"name": "t"}])
async def test_a_template_name_that_is_not_a_string_is_400_naming_the_field(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession, template: object
) -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"resourceClaims": [{"name": "c", "resourceClaimTemplateName": template}]},
    }
    status, text = await _post(http, orjson.dumps({"Pod": pod, "NodeNames": ["a"]}))
    assert status == 400, text
    assert _error(status, text).startswith(
        "Pod.spec.resourceClaims[0].resourceClaimTemplateName: not a string"
    )
    await _still_fine(advisor_process, http)


async def test_slow_senders_are_cut_off_after_the_idle_timeout(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession
) -> None:
    port = advisor_process.extender_port
    # Headers a byte at a time, never finished.
    await raw_connection_closed_within(port, b"POST /filter HTTP/1.1\r\n", b"X-a: b\r\n", IDLE_TIMEOUT_S + 5)
    # Nothing at all after connecting.
    await raw_connection_closed_within(port, b"", b"", IDLE_TIMEOUT_S + 5)
    # Whole headers, then a body that never completes: 408 (or closed), within the timeout.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), IDLE_TIMEOUT_S + 5)
        assert answer == b"" or (answer.startswith(b"HTTP/1.1 408") and b"--idle-timeout-s" in answer), (
            answer[:300]
        )
    finally:
        writer.close()
    await _still_fine(advisor_process, http)


async def test_connections_past_the_limit_are_closed(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession
) -> None:
    port = advisor_process.extender_port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await asyncio.wait_for(reader.read(100), 1.0) == b"", (
                "a connection past the limit was kept"
            )
        except ConnectionError:
            pass
        finally:
            writer.close()
    finally:
        for _, w in held:
            w.close()
    await asyncio.sleep(0.2)
    await _still_fine(advisor_process, http)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
_pods = st.fixed_dictionaries(
    {"metadata": st.dictionaries(st.sampled_from(["name", "namespace", "annotations"]), _json, max_size=3)},
    optional={
        "spec": st.fixed_dictionaries(
            {},
            optional={
                "resourceClaims": st.lists(
                    st.dictionaries(
                        st.sampled_from(["name", "resourceClaimTemplateName", "resourceClaimName", "source"]),
                        _json,
                    ),
                    max_size=3,
                )
                | _json
            },
        )
        | _json
    },
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "Pod": _pods | _json,
        "NodeNames": st.lists(st.text(max_size=10), max_size=4) | _json,
        "Nodes": _json,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies | _json, verb=st.sampled_from(["filter", "prioritize"]))
async def test_any_json_body_is_answered_or_refused_with_a_4xx(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession, body: object, verb: str
) -> None:
    status, text = await _post(http, json.dumps(body).encode(), verb)
    assert status in (200, 400), f"{status}: {text[:300]}"
    if status == 400:
        assert _error(status, text).startswith(_NAMED), text[:300]
    await advisor_process.healthy()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=200))
async def test_any_bytes_are_answered_or_refused_with_a_4xx(
    advisor_process: AdvisorProcess, http: aiohttp.ClientSession, body: bytes
) -> None:
    status, text = await _post(http, body)
    assert status in (200, 400), f"{status}: {text[:300]}"
    if status == 400:
        assert _error(status, text).startswith(_NAMED), text[:300]
    await advisor_process.healthy()
    advisor_process.assert_clean_log()
