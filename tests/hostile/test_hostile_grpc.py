"""Hostile input at the advisor's gRPC API, against a real advisor process.

Each input is followed by the four checks: the advisor is healthy (/healthz and a valid Place),
the refusal is clear (a named field or limit; never INTERNAL or UNKNOWN), nothing is lost (a
reservation made first is still held) and memory stays bounded (RSS under RSS_BOUND_MB).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.gen.computedomain.placement import v1 as pp
from services.advisor.transport import WireCodec
from tests.hostile.advisor_process import (
    GRPC_MAX_MESSAGE_BYTES,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_FIELD_BYTES,
    RSS_BOUND_MB,
    AdvisorProcess,
    raw_connection_closed_within,
    rss_mb,
)

HOLDER = "hostile-suite"
MB = 1024 * 1024
_UNCLEAR = (Status.INTERNAL, Status.UNKNOWN)
# Undecodable PlaceRequests: bad varints, a truncated length-delimited field, every byte value.
GARBAGE = (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab", bytes(range(256)))


@pytest.fixture
async def held(advisor_process: AdvisorProcess) -> AsyncIterator[tuple[pp.PlacementAdvisorStub, str]]:
    """A stub, and a reservation of 2 nodes made before the hostile input."""
    channel = Channel("127.0.0.1", advisor_process.grpc_port)
    stub = pp.PlacementAdvisorStub(channel, timeout=10.0)
    reply = await stub.place(
        pp.PlaceRequest(num_nodes=2, reserve=True, holder=HOLDER, reservation_ttl_seconds=300)
    )
    assert reply.feasible and reply.reservation_id
    try:
        yield stub, reply.reservation_id
    finally:
        await stub.release(pp.ReleaseRequest(reservation_id=reply.reservation_id, holder=HOLDER))
        channel.close()


async def _still_fine(advisor: AdvisorProcess, stub: pp.PlacementAdvisorStub, reservation_id: str) -> None:
    await advisor.healthy()
    capacity = await stub.get_capacity(pp.GetCapacityRequest())
    assert capacity.reserved_nodes >= 2, "the reservation made before the hostile input is gone"
    assert (await stub.place(pp.PlaceRequest(num_nodes=1, dry_run=True))).feasible
    assert rss_mb(advisor.pid) < RSS_BOUND_MB, f"advisor RSS {rss_mb(advisor.pid):.0f} MB"
    advisor.assert_clean_log()


async def _refused(call: object, status: Status, *named: str) -> str:
    with pytest.raises(GRPCError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.status is status, f"{caught.value.status}: {caught.value.message}"
    message = caught.value.message or ""
    for word in named:
        assert word in message, f"{word!r} not in {message[:300]!r}"
    assert len(message) < 1024, f"a {len(message)}-char error message echoes the input"
    return message


async def test_a_20_mb_message_is_refused_naming_the_limit(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    stub, reservation_id = held
    before = rss_mb(advisor_process.pid)
    for _ in range(3):
        await _refused(
            stub.place(pp.PlaceRequest(num_nodes=1, holder="h" * (20 * MB))),
            Status.RESOURCE_EXHAUSTED,
            str(GRPC_MAX_MESSAGE_BYTES),
            "grpc-max-message-bytes",
        )
    await _still_fine(advisor_process, stub, reservation_id)
    print(
        f"advisor RSS before three 20 MB messages {before:.0f} MB, after {rss_mb(advisor_process.pid):.0f} MB"
    )


@pytest.mark.parametrize(
    "request_fields, field",
    [
        ({"holder": "h" * MB}, "holder"),
        ({"domain_uid": "d" * MB}, "domain_uid"),
        ({"node_selector": {"name": "n" * MB}}, 'node_selector["name"]'),
        ({"excluded_nodes": ["x" * (MAX_FIELD_BYTES + 1)]}, "excluded_nodes"),
    ],
)
async def test_an_over_long_place_field_is_invalid_argument_naming_it(
    advisor_process: AdvisorProcess,
    held: tuple[pp.PlacementAdvisorStub, str],
    request_fields: dict[str, object],
    field: str,
) -> None:
    stub, reservation_id = held
    request = pp.PlaceRequest(num_nodes=1, reserve=True, reservation_ttl_seconds=30, **request_fields)
    await _refused(stub.place(request), Status.INVALID_ARGUMENT, field, f"limit is {MAX_FIELD_BYTES} bytes")
    await _still_fine(advisor_process, stub, reservation_id)


@pytest.mark.parametrize(
    "request_fields, field",
    [
        ({"holder": "h" * MB}, "holder"),
        ({"reservation_id": "r" * MB}, "reservation_id"),
        ({"domain_uid": "d" * MB}, "domain_uid"),
        ({"node_names": ["n" * MB]}, "node_names[0]"),
    ],
)
async def test_an_over_long_reserve_field_is_invalid_argument_naming_it(
    advisor_process: AdvisorProcess,
    held: tuple[pp.PlacementAdvisorStub, str],
    request_fields: dict[str, object],
    field: str,
) -> None:
    stub, reservation_id = held
    request = pp.ReserveRequest(**{"node_names": ["x"], **request_fields})
    await _refused(stub.reserve(request), Status.INVALID_ARGUMENT, field, f"limit is {MAX_FIELD_BYTES} bytes")
    await _still_fine(advisor_process, stub, reservation_id)


async def test_an_over_long_release_id_is_invalid_argument(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    stub, reservation_id = held
    await _refused(
        stub.release(pp.ReleaseRequest(reservation_id="r" * MB, holder=HOLDER)),
        Status.INVALID_ARGUMENT,
        "reservation_id",
        "limit",
    )
    await _still_fine(advisor_process, stub, reservation_id)


async def test_garbage_bytes_are_invalid_argument(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    stub, reservation_id = held
    channel = Channel("127.0.0.1", advisor_process.grpc_port, codec=WireCodec())
    try:
        for garbage in GARBAGE:
            async with channel.request(
                "/computedomain.placement.v1.PlacementAdvisor/Place",
                Cardinality.UNARY_UNARY,
                bytes,
                bytes,
                timeout=5,
            ) as call:
                await call.send_message(garbage, end=True)
                with pytest.raises(GRPCError) as caught:
                    await call.recv_message()
                assert caught.value.status not in _UNCLEAR, caught.value
    finally:
        channel.close()
    await _still_fine(advisor_process, stub, reservation_id)


async def test_a_preface_only_connection_is_closed_after_the_idle_timeout(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    stub, reservation_id = held
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    closed_after = await raw_connection_closed_within(
        advisor_process.grpc_port, preface, b"", IDLE_TIMEOUT_S + 5
    )
    assert closed_after >= IDLE_TIMEOUT_S * 0.9
    # A client dribbling a HEADERS frame a byte at a time never starts a call: closed too.
    frame_head = b"\x00\x00\x40\x01\x04\x00\x00\x00\x01"
    await raw_connection_closed_within(
        advisor_process.grpc_port, preface, frame_head + b"\x00" * 64, IDLE_TIMEOUT_S + 5
    )
    await _still_fine(advisor_process, stub, reservation_id)


async def test_connections_past_the_limit_are_closed(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    stub, reservation_id = held
    port = advisor_process.grpc_port
    kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            # The server's SETTINGS and a GOAWAY, then the end of the stream.
            received = await asyncio.wait_for(reader.read(), 2.0)
            assert received, "no GOAWAY before the close"
        except ConnectionError:
            pass
        finally:
            writer.close()
    finally:
        for _, w in kept:
            w.close()
    await asyncio.sleep(0.2)
    await _still_fine(advisor_process, stub, reservation_id)


async def test_an_idle_client_is_closed_and_its_next_call_reconnects(
    advisor_process: AdvisorProcess, held: tuple[pp.PlacementAdvisorStub, str]
) -> None:
    """The idle timeout costs a well-behaved client nothing: its channel connects again."""
    stub, reservation_id = held
    assert (await stub.place(pp.PlaceRequest(num_nodes=1, dry_run=True))).feasible
    await asyncio.sleep(IDLE_TIMEOUT_S * 2)
    for _ in range(3):
        assert (await stub.place(pp.PlaceRequest(num_nodes=1, dry_run=True))).feasible
    await _still_fine(advisor_process, stub, reservation_id)


_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.builds(
    lambda c, n: c * n, st.sampled_from("a/é\x00-"), st.integers(MAX_FIELD_BYTES - 2, 4 * MAX_FIELD_BYTES)
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    holder=_text,
    domain_uid=_text,
    reservation_id=_text,
    excluded=st.lists(_text, max_size=3),
    selector=st.dictionaries(st.sampled_from(["name", "clique", "rack", "bogus"]), _text, max_size=2),
    num_nodes=st.integers(-5, 40),
    ttl=st.integers(-10, 1000),
)
async def test_any_place_is_answered_or_refused_clearly(
    advisor_process: AdvisorProcess,
    held: tuple[pp.PlacementAdvisorStub, str],
    holder: str,
    domain_uid: str,
    reservation_id: str,
    excluded: list[str],
    selector: dict[str, str],
    num_nodes: int,
    ttl: int,
) -> None:
    stub, reservation_id_held = held
    request = pp.PlaceRequest(
        num_nodes=num_nodes,
        holder=holder,
        domain_uid=domain_uid,
        excluded_nodes=excluded,
        node_selector=selector,
        reservation_ttl_seconds=ttl,
        reserve=True,
    )
    try:
        reply = await stub.place(request)
    except GRPCError as exc:
        assert exc.status not in _UNCLEAR, f"{exc.status}: {exc.message}"
        assert exc.message and ":" in exc.message, "a refusal names its field"
        assert len(exc.message) < 1024
    else:
        if reply.reservation_id:
            await stub.release(pp.ReleaseRequest(reservation_id=reply.reservation_id, holder=holder))
    await _still_fine(advisor_process, stub, reservation_id_held)
