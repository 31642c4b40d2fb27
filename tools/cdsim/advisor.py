"""Asking the placement advisor where a job goes (gRPC `computedomain.placement.v1.PlacementAdvisor`)."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

import grpclib.client
import grpclib.exceptions
from grpclib.const import Status

from libs.gen.computedomain.placement import v1 as placement
from libs.runtime.backoff import Backoff

CALL_TIMEOUT_S = 10.0
RESERVATION_TTL_S = 120
# How long a release is retried while the advisor answers UNAVAILABLE or cannot be reached.
RELEASE_DEADLINE_S = 30.0

PLACEMENT_MODES = {
    "single-clique": placement.PlacementMode.REQUIRE_SINGLE_CLIQUE,
    "prefer-single-clique": placement.PlacementMode.PREFER_SINGLE_CLIQUE,
    "allow-split": placement.PlacementMode.ALLOW_SPLIT,
}


class PlacementRefused(RuntimeError):
    """The advisor cannot place the job; the message carries its reason."""


@dataclass(frozen=True)
class Placement:
    nodes: list[str]
    cliques: list[str]
    reservation_id: str
    score: float
    message: str


def _reason_name(reason: placement.Reason) -> str:
    try:
        return placement.Reason(reason).name or str(int(reason))
    except ValueError:
        return str(int(reason))


def _endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


async def place(
    endpoint: str,
    num_nodes: int,
    domain_uid: str,
    mode: str,
    holder: str,
    node_selector: dict[str, str] | None = None,
    excluded_nodes: list[str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> Placement:
    """Place and reserve `num_nodes` nodes for a domain, or raise PlacementRefused with the reason.

    `node_selector` (keys: name, clique, cluster, rack, ...) and `excluded_nodes` narrow the choice,
    e.g. to grow a job inside its own clique. `tls`: the client side of the advisor's mutual TLS
    (tools.cdsim.credentials.advisor_tls), None for plaintext.
    """
    host, port = _endpoint(endpoint)
    channel = grpclib.client.Channel(host, port, ssl=tls)
    try:
        stub = placement.PlacementAdvisorStub(channel)
        request = placement.PlaceRequest(
            num_nodes=num_nodes,
            mode=PLACEMENT_MODES[mode],
            policy=placement.Policy.BEST_FIT,
            domain_uid=domain_uid,
            reserve=True,
            reservation_ttl_seconds=RESERVATION_TTL_S,
            holder=holder,
            node_selector=dict(node_selector or {}),
            excluded_nodes=list(excluded_nodes or []),
        )
        try:
            response = await stub.place(request, timeout=CALL_TIMEOUT_S)
        except grpclib.exceptions.GRPCError as exc:
            raise PlacementRefused(f"{exc.status.name}: {exc.message}") from None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise PlacementRefused(f"the placement advisor at {endpoint} is not reachable: {exc}") from None
        except grpclib.exceptions.StreamTerminatedError as exc:
            # What a client without the certificate a mutual TLS advisor requires sees.
            raise PlacementRefused(
                f"the placement advisor at {endpoint} closed the connection ({exc}): with mutual TLS "
                f"it refuses a client without a certificate of its CA"
            ) from None
    finally:
        channel.close()
    if not response.feasible:
        raise PlacementRefused(f"{_reason_name(response.reason)}: {response.message}")
    nodes = [n for segment in response.placements for n in segment.node_names]
    cliques = [segment.clique_id for segment in response.placements]
    return Placement(nodes, cliques, response.reservation_id, response.score, response.message)


async def release(
    endpoint: str,
    reservation_id: str,
    *,
    holder: str,
    deadline_s: float = RELEASE_DEADLINE_S,
    tls: ssl.SSLContext | None = None,
) -> bool:
    """Drop a reservation (its nodes are bound to the domain by now); False if it had expired, or
    could not be dropped within `deadline_s`. `holder`: as it was placed with (only the holder may
    release; with mutual TLS the advisor takes the client certificate's name instead).

    A release refused as unavailable (etcd restarting, the advisor restarting) is retried with
    backoff: a reservation left behind keeps its nodes from every other job for the rest of its TTL
    (RESERVATION_TTL_S), after this job is gone too."""
    if not reservation_id:
        return False
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + deadline_s
    backoff = Backoff(initial=0.2, cap=2.0)
    while True:
        try:
            return await _release_once(endpoint, reservation_id, holder, tls)
        except grpclib.exceptions.GRPCError as exc:
            if exc.status not in _RETRYABLE:
                return False
        except (OSError, TimeoutError, grpclib.exceptions.StreamTerminatedError):
            pass
        delay = backoff.next_delay()
        if loop.time() + delay >= give_up_at:
            return False
        await asyncio.sleep(delay)


_RETRYABLE = frozenset({Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED})


async def _release_once(endpoint: str, reservation_id: str, holder: str, tls: ssl.SSLContext | None) -> bool:
    host, port = _endpoint(endpoint)
    channel = grpclib.client.Channel(host, port, ssl=tls)
    try:
        stub = placement.PlacementAdvisorStub(channel)
        response = await stub.release(
            placement.ReleaseRequest(reservation_id=reservation_id, holder=holder), timeout=CALL_TIMEOUT_S
        )
        return bool(response.released)
    finally:
        channel.close()
