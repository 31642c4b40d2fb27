"""The PlacementAdvisor gRPC service (grpclib, betterproto base class): wire <-> model translation.

Errors map to gRPC status codes with a message naming the culprit:
INVALID_ARGUMENT (bad input, the field is named), ABORTED (nodes taken by a
concurrent writer), ALREADY_EXISTS (reservation id in use), FAILED_PRECONDITION
(a named node is unhealthy), PERMISSION_DENIED (a Release by another than the
reservation's holder), UNAVAILABLE (inventory not synced yet, or the store
unreachable). A failed call never stops the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpclib.server
import structlog
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from libs.gen.computedomain.placement import v1 as pp
from libs.state.store import TRANSIENT_ERRORS, StoreUnavailable
from services.advisor.advisor import (
    Advisor,
    HolderOverCap,
    NodeUnavailable,
    ReservationContention,
)
from services.advisor.auth import charged_holder
from services.advisor.capacity import CapacityReport
from services.advisor.explanation import Alternative
from services.advisor.fleet_feeds import wait_changed
from services.advisor.model import (
    Decision,
    InvalidRequest,
    Mode,
    PlacementRequest,
    PolicyName,
    Reason,
    ReservationInfo,
    Segment,
)
from services.advisor.reservations import NotHolder, ReservationConflict, ReservationExists
from services.advisor.wire import (
    decode_place_request,
    decode_release_request,
    encode_place_response,
    encode_release_response,
)

log = structlog.get_logger(__name__)

_MODES = {
    pp.PlacementMode.UNSPECIFIED.value: Mode.REQUIRE_SINGLE_CLIQUE,
    pp.PlacementMode.REQUIRE_SINGLE_CLIQUE.value: Mode.REQUIRE_SINGLE_CLIQUE,
    pp.PlacementMode.PREFER_SINGLE_CLIQUE.value: Mode.PREFER_SINGLE_CLIQUE,
    pp.PlacementMode.ALLOW_SPLIT.value: Mode.ALLOW_SPLIT,
}
_POLICIES = {
    pp.Policy.UNSPECIFIED.value: PolicyName.BEST_FIT,
    pp.Policy.BEST_FIT.value: PolicyName.BEST_FIT,
    pp.Policy.FIRST_FIT.value: PolicyName.FIRST_FIT,
    pp.Policy.RANDOM.value: PolicyName.RANDOM,
    pp.Policy.SPREAD.value: PolicyName.SPREAD,
}
_POLICY_OUT = {
    PolicyName.BEST_FIT: pp.Policy.BEST_FIT,
    PolicyName.FIRST_FIT: pp.Policy.FIRST_FIT,
    PolicyName.RANDOM: pp.Policy.RANDOM,
    PolicyName.SPREAD: pp.Policy.SPREAD,
}
_REASON_OUT = {
    None: pp.Reason.UNSPECIFIED,
    Reason.NO_CAPACITY: pp.Reason.NO_CAPACITY,
    Reason.NO_SINGLE_CLIQUE_FIT: pp.Reason.NO_SINGLE_CLIQUE_FIT,
    Reason.FRAGMENTED: pp.Reason.FRAGMENTED,
    Reason.UNHEALTHY_FABRIC: pp.Reason.UNHEALTHY_FABRIC,
}
_UNAVAILABLE: tuple[type[BaseException], ...] = (StoreUnavailable, *TRANSIENT_ERRORS)
DEFAULT_WATCH_INTERVAL_MS = 100
# Requests of one PlaceStream decided but not yet answered (reserving ones wait for their write).
STREAM_WINDOW = 64
MAX_EXPLAIN_ALTERNATIVES = 50


def to_request(msg: pp.PlaceRequest, field_prefix: str = "") -> PlacementRequest:
    """Wire request -> model; InvalidRequest for enum values this server does not know."""
    mode = _MODES.get(int(msg.mode))
    if mode is None:
        raise InvalidRequest(f"{field_prefix}mode", f"unknown placement mode {int(msg.mode)}")
    policy = _POLICIES.get(int(msg.policy))
    if policy is None:
        raise InvalidRequest(f"{field_prefix}policy", f"unknown policy {int(msg.policy)}")
    return PlacementRequest(
        num_nodes=msg.num_nodes,
        gpus_per_node=msg.gpus_per_node,
        mode=mode,
        segment_size=msg.segment_size,
        node_selector=dict(msg.node_selector),
        excluded_nodes=frozenset(msg.excluded_nodes),
        candidate_nodes=frozenset(msg.candidate_nodes) if msg.candidate_nodes else None,
        policy=policy,
        dry_run=msg.dry_run,
        domain_uid=msg.domain_uid,
        reserve=msg.reserve,
        reservation_ttl_s=msg.reservation_ttl_seconds,
        holder=msg.holder,
        seed=msg.seed,
    )


def _segments(segments: tuple[Segment, ...]) -> list[pp.Segment]:
    return [pp.Segment(clique_id=s.clique_id, node_names=list(s.node_names)) for s in segments]


def to_response(decision: Decision) -> pp.PlaceResponse:
    reservation = decision.reservation
    return pp.PlaceResponse(
        feasible=decision.feasible,
        placements=_segments(decision.segments),
        score=decision.score,
        fragmentation_before=decision.fragmentation_before,
        fragmentation_after=decision.fragmentation_after,
        reason=_REASON_OUT[decision.reason],
        message=decision.message,
        reservation_id=reservation.id if reservation else "",
        reservation_expires_unix_ms=reservation.expires_unix_ms if reservation else 0,
        policy=_POLICY_OUT[decision.policy],
        largest_free_block_before=decision.largest_free_block_before,
        largest_free_block_after=decision.largest_free_block_after,
    )


def to_reservation(info: ReservationInfo) -> pp.ReservationInfo:
    return pp.ReservationInfo(
        id=info.id,
        node_names=list(info.node_names),
        clique_ids=list(info.clique_ids),
        domain_uid=info.domain_uid,
        holder=info.holder,
        ttl_seconds=info.ttl_s,
        expires_unix_ms=info.expires_unix_ms,
    )


def to_capacity(report: CapacityReport) -> pp.Capacity:
    return pp.Capacity(
        cliques=[
            pp.CliqueCapacity(
                clique_id=c.clique_id,
                cluster_uuid=c.cluster_uuid,
                total_nodes=c.total_nodes,
                healthy_nodes=c.healthy_nodes,
                free_nodes=c.free_nodes,
                reserved_nodes=c.reserved_nodes,
                bound_nodes=c.bound_nodes,
            )
            for c in report.cliques
        ],
        total_nodes=report.total_nodes,
        healthy_nodes=report.healthy_nodes,
        free_nodes=report.free_nodes,
        reserved_nodes=report.reserved_nodes,
        bound_nodes=report.bound_nodes,
        largest_free_block=report.largest_free_block,
        fragmentation=report.fragmentation,
        generation=report.generation,
    )


def _alternative(alt: Alternative) -> pp.Alternative:
    return pp.Alternative(
        placements=_segments(alt.segments), score=alt.score, description=alt.description, chosen=alt.chosen
    )


@contextmanager
def grpc_errors(method: str) -> Iterator[None]:
    """Translate the advisor's exceptions into gRPC statuses; anything else is INTERNAL, logged."""
    try:
        yield
    except GRPCError:
        raise
    except InvalidRequest as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except (ReservationConflict, ReservationContention) as exc:
        raise GRPCError(Status.ABORTED, str(exc)) from None
    except ReservationExists as exc:
        raise GRPCError(Status.ALREADY_EXISTS, str(exc)) from None
    except NodeUnavailable as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except HolderOverCap as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except NotHolder as exc:
        raise GRPCError(Status.PERMISSION_DENIED, str(exc)) from None
    except _UNAVAILABLE as exc:
        raise GRPCError(Status.UNAVAILABLE, f"store unavailable: {exc or type(exc).__name__}") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("request failed", method=method)
        raise GRPCError(Status.INTERNAL, f"{type(exc).__name__}: {exc}") from None


_SERVICE = "/computedomain.placement.v1.PlacementAdvisor"


def _charged(request: PlacementRequest) -> PlacementRequest:
    """A request over gRPC reserves for its authenticated client, whatever holder it names."""
    holder = charged_holder(request.holder)
    return request if holder == request.holder else replace(request, holder=holder)


class PlacementService(pp.PlacementAdvisorBase):
    """Serve with `transport.WireCodec`: Place, PlaceStream and Release read and write the wire
    format directly (their handlers replace the generated ones in `__mapping__`)."""

    def __init__(self, advisor: Advisor) -> None:
        self.advisor = advisor

    def __mapping__(self) -> dict[str, Handler]:
        mapping = super().__mapping__()
        mapping[f"{_SERVICE}/Place"] = Handler(self._place_wire, Cardinality.UNARY_UNARY, bytes, bytes)
        mapping[f"{_SERVICE}/PlaceStream"] = Handler(
            self._place_stream_wire, Cardinality.STREAM_STREAM, bytes, bytes
        )
        # A scheduler releases as often as it reserves.
        mapping[f"{_SERVICE}/Release"] = Handler(self._release_wire, Cardinality.UNARY_UNARY, bytes, bytes)
        return mapping

    async def _decide_wire(self, data: bytes, method: str) -> bytes:
        with grpc_errors(method):
            decision = await self.advisor.place(_charged(decode_place_request(data)), capped=True)
            return encode_place_response(decision)

    async def _place_wire(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        data = await stream.recv_message()
        assert data is not None
        self._require_ready()
        await stream.send_message(await self._decide_wire(data, "Place"))

    async def _place_stream_wire(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        """Requests are decided in arrival order as they arrive, and answered in that order; a
        reserving one does not hold up the next while its write is in flight (up to
        STREAM_WINDOW of them). A failed request ends the stream with its status after the
        answers before it; the requests after it are cancelled, and their reservations removed."""
        self._require_ready()
        answers: asyncio.Queue[asyncio.Future[bytes] | None] = asyncio.Queue(STREAM_WINDOW)
        reader = asyncio.create_task(self._read_stream(stream, answers))
        try:
            while True:
                answer = await answers.get()
                if answer is None:
                    break
                await stream.send_message(await answer)
            await reader
        finally:
            reader.cancel()
            while not answers.empty():
                left = answers.get_nowait()
                if left is None:
                    continue
                if left.done() and not left.cancelled():
                    left.exception()  # retrieved: the stream ended before its answer
                left.cancel()

    async def _read_stream(
        self,
        stream: grpclib.server.Stream[bytes, bytes],
        answers: asyncio.Queue[asyncio.Future[bytes] | None],
    ) -> None:
        loop = asyncio.get_running_loop()
        async for data in stream:
            answer: asyncio.Future[bytes]
            try:
                request = _charged(decode_place_request(data))
                if request.reserve and not request.dry_run:
                    # Refused input ends the stream here, before any later request reserves.
                    self.advisor.check(request)
                    answer = asyncio.ensure_future(self._reserve_wire(request))
                else:
                    # No write: decided here, without a task.
                    answer = loop.create_future()
                    with grpc_errors("PlaceStream"):
                        answer.set_result(encode_place_response(self.advisor.decide(request)))
            except GRPCError as exc:
                answer = loop.create_future()
                answer.set_exception(exc)
            except InvalidRequest as exc:
                answer = loop.create_future()
                answer.set_exception(GRPCError(Status.INVALID_ARGUMENT, str(exc)))
            await answers.put(answer)
            if answer.done() and answer.exception() is not None:
                return  # the stream ends with this request's status; read no further
        await answers.put(None)

    async def _release_wire(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        data = await stream.recv_message()
        assert data is not None
        with grpc_errors("Release"):
            reservation_id, declared = decode_release_request(data)
            released, nodes = await self.advisor.release(reservation_id, charged_holder(declared))
        await stream.send_message(encode_release_response(released, nodes))

    async def _reserve_wire(self, request: PlacementRequest) -> bytes:
        with grpc_errors("PlaceStream"):
            return encode_place_response(await self.advisor.place(request, capped=True))

    def _require_ready(self) -> None:
        if not self.advisor.fleet.ready:
            raise GRPCError(Status.UNAVAILABLE, "inventory not synced with the store yet; retry shortly")

    async def reserve(self, reserve_request: pp.ReserveRequest) -> pp.ReserveResponse:
        self._require_ready()
        with grpc_errors("Reserve"):
            info = await self.advisor.reserve_nodes(
                list(reserve_request.node_names),
                reserve_request.domain_uid,
                reserve_request.ttl_seconds,
                charged_holder(reserve_request.holder),
                reserve_request.reservation_id,
                capped=True,
            )
            return pp.ReserveResponse(reservation=to_reservation(info))

    async def get_capacity(self, get_capacity_request: pp.GetCapacityRequest) -> pp.Capacity:
        self._require_ready()
        with grpc_errors("GetCapacity"):
            return to_capacity(self.advisor.capacity(dict(get_capacity_request.node_selector)))

    async def watch_capacity(
        self, watch_capacity_request: pp.WatchCapacityRequest
    ) -> AsyncIterator[pp.Capacity]:
        interval_ms = watch_capacity_request.min_interval_ms
        if interval_ms < 0:
            raise GRPCError(Status.INVALID_ARGUMENT, f"min_interval_ms: must be >= 0, got {interval_ms}")
        interval = (interval_ms or DEFAULT_WATCH_INTERVAL_MS) / 1000
        fleet = self.advisor.fleet
        self._require_ready()
        while True:
            generation = fleet.generation
            with grpc_errors("WatchCapacity"):
                snapshot = to_capacity(self.advisor.capacity())
            yield snapshot
            await wait_changed(fleet, generation)
            # Coalesce bursts of changes into one snapshot per interval.
            await asyncio.sleep(interval)

    async def explain(self, explain_request: pp.ExplainRequest) -> pp.ExplainResponse:
        self._require_ready()
        limit = explain_request.max_alternatives or 5
        if limit < 0 or limit > MAX_EXPLAIN_ALTERNATIVES:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"max_alternatives: must be in [0, {MAX_EXPLAIN_ALTERNATIVES}], got {explain_request.max_alternatives}",
            )
        with grpc_errors("Explain"):
            try:
                explanation = self.advisor.explain(to_request(explain_request.request, "request."), limit)
            except InvalidRequest as exc:
                field_name = exc.field if exc.field.startswith("request.") else f"request.{exc.field}"
                raise InvalidRequest(field_name, exc.message) from None
            return pp.ExplainResponse(
                decision=to_response(explanation.decision),
                alternatives=[_alternative(a) for a in explanation.alternatives],
            )
