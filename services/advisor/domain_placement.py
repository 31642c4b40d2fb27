"""Keeping the pods of one ComputeDomain inside the NVLink clique chosen for it (extender logic).

The first pod of a domain that reaches the scheduler reserves nodes for the
whole domain: spec.numNodes if set, else the size hint annotation of the pod,
else one node at a time (in the clique with the most room, so the domain can
grow there). Later pods of the domain may only go to nodes reserved for or
bound to it; when none of those is left among the scheduler's candidates, one
more node is reserved in the domain's clique(s). The clique(s) of a domain's first reservation
are remembered while the domain lives: if that reservation lapses (its TTL) before all the
domain's pods are bound, and no node of the domain has joined it yet, the pods still bound hold
nodes there that the advisor cannot see, so later pods get one node at a time in those cliques,
never a fresh placement of the whole domain elsewhere (which split a gang over two cliques:
kube-scheduler keeps an unschedulable pod queued for up to 5 minutes, as long as the TTL).
Reservations use fixed, unguessable ids
(`reservation_ids.py`), so two advisor replicas cannot both make the first one. Once its nodes
are bound to the domain, or the domain is gone, the reaper releases such a reservation
(`reservation_reaper.py`); a pod of a domain known to be gone is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from services.advisor.advisor import Advisor, ReservationContention
from services.advisor.domain_presence import DomainPresence
from services.advisor.fleet_feeds import wait_until
from services.advisor.model import InvalidRequest, Mode, PlacementRequest, PolicyName
from services.advisor.reservation_ids import ExtenderIds
from services.advisor.reservations import ReservationExists

log = structlog.get_logger(__name__)

SIZE_ANNOTATION = "resource.nvidia.com/computeDomainSize"
MAX_PRIORITY = 10  # kube-scheduler's MaxExtenderPriority
UNKNOWN_NODE = "no node record in the placement advisor's inventory (node agent down or its lease lapsed)"
# The service's extender holds reservations as `extender/<replica identity>`: every replica's
# reaper recognises those of the others by this prefix.
EXTENDER_HOLDER_PREFIX = "extender/"
# Domains whose cliques a placer remembers; past that the oldest are forgotten.
MAX_REMEMBERED_DOMAINS = 10_000


@dataclass(frozen=True, slots=True)
class Allowance:
    """Where a pod of the domain may go; `message` explains the others."""

    allowed: frozenset[str]
    cliques: tuple[str, ...]
    message: str
    # True when more capacity (or preemption) could change the answer.
    resolvable: bool = True


class DomainPlacer:
    def __init__(
        self,
        advisor: Advisor,
        ttl_s: int = 300,
        holder: str = "kube-scheduler-extender",
        presence: DomainPresence | None = None,
        ids: ExtenderIds | None = None,
    ) -> None:
        self.advisor = advisor
        # The replicas' shared key in production (main.py); a key of its own otherwise.
        self.ids = ids if ids is not None else ExtenderIds()
        self.ttl_s = ttl_s
        self.holder = holder
        # Which domains are gone (None: not known; every domain is then taken to be live).
        self.presence = presence
        self._locks: dict[str, asyncio.Lock] = {}
        # Domain uid -> the cliques its reservations went to (oldest first; capped).
        self._placed_in: dict[str, tuple[str, ...]] = {}

    def made_by_extender(self, record: pb.Reservation) -> bool:
        """Whether the reservation is one an extender (this one or another replica's) made for
        its domain's pods; those of other holders (gRPC clients) are theirs to release."""
        if not record.domain_uid or self.ids.sequence_of(record.domain_uid, record.id) is None:
            return False
        return record.holder == self.holder or record.holder.startswith(EXTENDER_HOLDER_PREFIX)

    def _lock(self, domain_uid: str) -> asyncio.Lock:
        lock = self._locks.get(domain_uid)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[domain_uid] = asyncio.Lock()
        return lock

    def placed_in(self, domain_uid: str) -> tuple[str, ...]:
        """The cliques this advisor reserved nodes of the domain in (even if those are gone)."""
        return self._placed_in.get(domain_uid, ())

    def _remember(self, domain_uid: str, cliques: tuple[str, ...]) -> None:
        if not cliques:
            return
        self._placed_in.pop(domain_uid, None)
        self._placed_in[domain_uid] = cliques
        while len(self._placed_in) > MAX_REMEMBERED_DOMAINS:
            del self._placed_in[next(iter(self._placed_in))]

    def _cliques_of(self, nodes: Iterable[str]) -> tuple[str, ...]:
        inv = self.advisor.fleet
        found = {inv.nodes[n].clique for n in nodes if n in inv.nodes and inv.nodes[n].clique}
        return tuple(sorted(found))

    async def allowed_nodes(
        self, domain_uid: str, size: int | None, candidates: Collection[str]
    ) -> Allowance:
        """The candidates a pod of the domain may use, reserving for the domain when needed."""
        if self.presence is not None and self.presence.is_gone(domain_uid):
            self._placed_in.pop(domain_uid, None)
            # Its claims could not be prepared anyway; a reservation would only be released again.
            return Allowance(
                frozenset(), (), f"ComputeDomain {domain_uid} is being deleted", resolvable=False
            )
        async with self._lock(domain_uid):
            for _ in range(3):
                try:
                    return await self._allowed_nodes(domain_uid, size, candidates)
                except ReservationExists as exc:
                    # Another advisor replica made this reservation just now: wait for our watch to show it.
                    await self._wait_for_reservation(exc.reservation_id)
            return Allowance(frozenset(), (), f"ComputeDomain {domain_uid}: reservation keeps racing; retry")

    async def _wait_for_reservation(self, rid: str) -> None:
        inv = self.advisor.fleet

        def seen() -> bool:
            return rid in inv.reservations

        await wait_until(inv, seen, 2.0)

    async def _allowed_nodes(
        self, domain_uid: str, size: int | None, candidates: Collection[str]
    ) -> Allowance:
        inv = self.advisor.fleet
        candidate_set = frozenset(candidates)
        held = inv.domain_nodes(domain_uid)
        known = frozenset(n for n in candidate_set if n in inv.nodes)
        if not held and known and not any(inv.nodes[n].clique for n in known):
            # No NVLink fabric among the candidates: the domain is a plain node set there,
            # so there is no clique to keep it in (and no reason to refuse the nodes). A node
            # without a record (its agent down, its lease lapsed) is not known to lack a
            # fabric: letting a domain's pods onto such nodes would split it over cliques.
            return Allowance(known, (), UNKNOWN_NODE, True)
        cliques = self._cliques_of(held) or self.placed_in(domain_uid)
        usable = held & candidate_set
        if usable:
            return Allowance(frozenset(usable), cliques, self._outside_message(domain_uid, cliques), False)
        sequence = self.ids.next_sequence(domain_uid, (r.id for r in inv.domain_reservations(domain_uid)))
        if not held and not cliques:
            wanted = size or 1
            request = PlacementRequest(
                num_nodes=wanted,
                # By the cliques' full size: with some records lapsed, the current largest clique
                # looks smaller than the domain, which then may not be split over cliques.
                mode=Mode.REQUIRE_SINGLE_CLIQUE
                if wanted <= inv.largest_clique_seen()
                else Mode.PREFER_SINGLE_CLIQUE,
                candidate_nodes=candidate_set,
                # Unknown size: start where the domain has the most room to grow.
                policy=PolicyName.BEST_FIT if size else PolicyName.SPREAD,
                domain_uid=domain_uid,
                reserve=True,
                reservation_ttl_s=self.ttl_s,
                holder=self.holder,
                reservation_id=self.ids.make(domain_uid, sequence),
            )
            what = f"{wanted} node(s) for ComputeDomain {domain_uid}"
        else:
            in_cliques = frozenset(
                n for n in candidate_set if n in inv.nodes and inv.nodes[n].clique in cliques
            )
            if not in_cliques:
                return Allowance(
                    frozenset(),
                    cliques,
                    f"ComputeDomain {domain_uid} lives in clique(s) {', '.join(cliques)}, "
                    f"and none of their nodes is available to this pod",
                )
            request = PlacementRequest(
                num_nodes=1,
                mode=Mode.REQUIRE_SINGLE_CLIQUE,
                candidate_nodes=in_cliques,
                domain_uid=domain_uid,
                reserve=True,
                reservation_ttl_s=self.ttl_s,
                holder=self.holder,
                reservation_id=self.ids.make(domain_uid, sequence),
            )
            what = f"one more node for ComputeDomain {domain_uid} in clique(s) {', '.join(cliques)}"
        try:
            decision = await self.advisor.place(request)
            if not decision.feasible and not held:
                # kube-scheduler stops filtering once it has found enough feasible nodes for one
                # pod (percentageOfNodesToScore): the nodes it did not send were not refused, only
                # not looked at. The domain's other pods may land there, so a domain larger than the
                # sample is placed on the candidates' cliques, then on the whole fabric.
                for wider in self._wider_than(candidate_set):
                    decision = await self.advisor.place(dataclasses.replace(request, candidate_nodes=wider))
                    if decision.feasible:
                        break
        except InvalidRequest as exc:
            return Allowance(frozenset(), cliques, f"cannot place {what}: {exc}", resolvable=False)
        except ReservationContention as exc:
            return Allowance(frozenset(), cliques, f"cannot place {what}: {exc}")
        if not decision.feasible:
            reason = decision.reason.value if decision.reason else "?"
            return Allowance(frozenset(), cliques, f"cannot place {what}: {reason}: {decision.message}")
        reserved = frozenset(decision.node_names)
        new_cliques = self._cliques_of(held | reserved)
        self._remember(domain_uid, new_cliques)
        log.info(
            "reserved for domain",
            cd_uid=domain_uid,
            nodes=len(reserved),
            clique=",".join(new_cliques),
            reservation=decision.reservation.id if decision.reservation else None,
        )
        return Allowance(
            reserved & candidate_set, new_cliques, self._outside_message(domain_uid, new_cliques), False
        )

    def _wider_than(self, candidates: frozenset[str]) -> list[frozenset[str] | None]:
        """Larger candidate sets to try, smallest first: every node of the candidates' cliques,
        then every node (None)."""
        inv = self.advisor.fleet
        cliques = set(self._cliques_of(candidates))
        same_cliques = frozenset(name for name, entry in inv.nodes.items() if entry.clique in cliques)
        out: list[frozenset[str] | None] = []
        if len(same_cliques) > len(candidates):
            out.append(same_cliques)
        if len(inv.nodes) > max(len(candidates), len(same_cliques)):
            out.append(None)
        return out

    @staticmethod
    def _outside_message(domain_uid: str, cliques: tuple[str, ...]) -> str:
        return (
            f"not among the nodes reserved for ComputeDomain {domain_uid} in clique(s) {', '.join(cliques)}"
        )

    def scores(self, domain_uid: str, size: int | None, candidates: Collection[str]) -> dict[str, int]:
        """0..10 per candidate: held by the domain 10, same clique 5; else the clique's best-fit score."""
        inv = self.advisor.fleet
        held = inv.domain_nodes(domain_uid)
        cliques = set(self._cliques_of(held))
        out: dict[str, int] = {}
        wanted = size or 1
        for name in candidates:
            entry = inv.nodes.get(name)
            if name in held:
                out[name] = MAX_PRIORITY
            elif entry is None or not entry.clique:
                out[name] = 0
            elif cliques:
                out[name] = MAX_PRIORITY // 2 if entry.clique in cliques else 0
            else:
                free = len(inv.cliques[entry.clique].free)
                # The same fill ratio the best-fit score uses: tight fits first.
                out[name] = round(MAX_PRIORITY * wanted / free) if free >= wanted else 0
        return out
