"""The advisor's core: validate a request, decide a placement, reserve it (the policy input is
built in `views`, capacity reports in `capacity`, explanations in `explanation`).

`decide` is synchronous: it reads the fleet index and runs a policy without
awaiting, so in one process two decisions never interleave. `place` with
reserve=true marks the chosen nodes as held in the fleet index *before* its first
await and writes the reservation; a conflict with another advisor (or a
binding the watch has not delivered yet) hides the taken nodes and decides again.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from libs.runtime.backoff import Backoff
from libs.runtime.errors import PermanentError, RetryableError
from libs.runtime.text_limits import clip, too_long
from libs.state.store import Store
from services.advisor import policies
from services.advisor.capacity import CapacityReport, capacity_report
from services.advisor.commit_batcher import CommitBatcher
from services.advisor.explanation import Explanation, explain
from services.advisor.fleet_index import FleetIndex
from services.advisor.metrics import AdvisorMetrics
from services.advisor.model import (
    SELECTOR_KEYS,
    Decision,
    InvalidRequest,
    Mode,
    PlacementRequest,
    PolicyName,
    Reason,
    ReservationInfo,
)
from services.advisor.policies import Demand, Infeasible, PlacementPlan
from services.advisor.reservations import (
    NotHolder,
    ReservationConflict,
    ReservationExists,
    Written,
    delete_reservation,
    fits_one_txn,
    new_reservation_id,
    remove_in_one_txn,
    write_reservation,
)
from services.advisor.views import View, view_for

log = structlog.get_logger(__name__)


class ReservationContention(RetryableError, RuntimeError):
    """Every attempt to reserve lost to concurrent writers."""


class NodeUnavailable(PermanentError, RuntimeError):
    """An explicitly named node cannot be reserved (unknown to the store, or unhealthy). Permanent,
    like its FAILED_PRECONDITION: the node must be repaired first."""


class HolderOverCap(RetryableError, RuntimeError):
    """The reservation would take its holder past --max-reserved-nodes-per-holder. Retryable: the
    holder's reservations expire by themselves."""


@dataclass(frozen=True)
class AdvisorConfig:
    default_ttl_s: int = 60
    max_ttl_s: int = 600
    holder: str = "placement-advisor"
    # Nodes one client (holder) may hold reserved at a time; 0 = no cap.
    max_nodes_per_holder: int = 0
    # Longest holder, domain_uid, reservation_id or node name taken (bytes, UTF-8).
    max_field_bytes: int = 253
    reserve_attempts: int = 8
    # How long nodes another writer took stay hidden while our watch catches up.
    hint_seconds: float = 2.0


class Advisor:
    def __init__(
        self,
        fleet: FleetIndex,
        store: Store | None = None,
        config: AdvisorConfig | None = None,
        metrics: AdvisorMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.config = config or AdvisorConfig()
        self.metrics = metrics or AdvisorMetrics()
        self.rng = rng or random.Random()
        # Reservation writes and releases of concurrent requests share etcd transactions.
        self.batcher = CommitBatcher(store) if store is not None else None

    async def close(self) -> None:
        """Let reservation writes in flight finish (bounded); refuse new ones."""
        if self.batcher is not None:
            await self.batcher.close()

    def _check_holder_cap(self, holder: str, more: int, capped: bool) -> None:
        cap = self.config.max_nodes_per_holder
        if not capped or not cap:
            return
        held = sum(len(r.node_names) for r in self.fleet.reservations.values() if r.holder == holder)
        if held + more > cap:
            self.metrics.reservations.labels("over-cap").inc()
            raise HolderOverCap(
                f"holder {holder!r} holds {held} reserved node(s); {more} more would pass its cap of {cap} "
                "(--max-reserved-nodes-per-holder)"
            )

    def _check_ttl(self, ttl_s: int, field_name: str) -> None:
        if ttl_s < 0 or ttl_s > self.config.max_ttl_s:
            raise InvalidRequest(field_name, f"must be in [0, {self.config.max_ttl_s}] seconds, got {ttl_s}")

    def _check_lengths(self, fields: Mapping[str, str]) -> None:
        """Each named string fits `max_field_bytes`: checked before anything reaches the store."""
        limit = self.config.max_field_bytes
        for name, value in fields.items():
            problem = too_long(value, limit)
            if problem:
                raise InvalidRequest(name, f"{problem} (--max-field-bytes)")

    def _check_names(self, field_name: str, names: Iterable[str]) -> None:
        limit = self.config.max_field_bytes
        for name in names:
            problem = too_long(name, limit)
            if problem:
                raise InvalidRequest(field_name, f"a node name is {problem} (--max-field-bytes)")

    def _check_selector(self, selector: Mapping[str, str]) -> None:
        inv = self.fleet
        for key, value in selector.items():
            name = f'node_selector["{clip(key, 64)}"]'
            if key not in SELECTOR_KEYS:
                raise InvalidRequest(name, f"unknown key; known keys: {', '.join(SELECTOR_KEYS)}")
            if not value:
                raise InvalidRequest(name, "empty value")
            self._check_lengths({name: value})
            if key == "clique" and value not in inv.cliques:
                raise InvalidRequest(name, f"unknown clique {clip(repr(value))}")
            if key in ("cluster", "rack") and value not in inv.cliques_by_cluster:
                raise InvalidRequest(name, f"unknown {key} {clip(repr(value))}")
            if key == "name" and value not in inv.nodes:
                raise InvalidRequest(name, f"unknown node {clip(repr(value))}")

    def validate(self, req: PlacementRequest) -> None:
        inv = self.fleet
        if req.num_nodes <= 0:
            raise InvalidRequest("num_nodes", f"must be > 0, got {req.num_nodes}")
        if req.num_nodes > len(inv.nodes):
            raise InvalidRequest(
                "num_nodes", f"{req.num_nodes} is larger than the cluster ({len(inv.nodes)} nodes known)"
            )
        if req.gpus_per_node < 0:
            raise InvalidRequest("gpus_per_node", f"must be >= 0, got {req.gpus_per_node}")
        if req.gpus_per_node > inv.max_gpus():
            raise InvalidRequest(
                "gpus_per_node", f"{req.gpus_per_node} is more than any node has (at most {inv.max_gpus()})"
            )
        if req.segment_size < 0:
            raise InvalidRequest("segment_size", f"must be >= 0, got {req.segment_size}")
        if req.segment_size > 0:
            if req.mode is not Mode.ALLOW_SPLIT:
                raise InvalidRequest(
                    "segment_size", f"only meaningful with ALLOW_SPLIT, not {req.mode.value}"
                )
            if req.num_nodes % req.segment_size:
                raise InvalidRequest(
                    "segment_size",
                    f"num_nodes ({req.num_nodes}) must be a multiple of segment_size ({req.segment_size})",
                )
        self._check_lengths(
            {"holder": req.holder, "domain_uid": req.domain_uid, "reservation_id": req.reservation_id}
        )
        self._check_names("excluded_nodes", req.excluded_nodes)
        self._check_names("candidate_nodes", req.candidate_nodes or ())
        self._check_selector(req.node_selector)
        self._check_ttl(req.reservation_ttl_s, "reservation_ttl_seconds")
        if "/" in req.domain_uid:
            raise InvalidRequest("domain_uid", "must not contain '/'")
        if "/" in req.reservation_id:
            raise InvalidRequest("reservation_id", "must not contain '/'")

    def check(self, req: PlacementRequest) -> None:
        """`validate`, counting a refusal in the metrics."""
        try:
            self.validate(req)
        except InvalidRequest as exc:
            self.metrics.invalid_requests.labels(exc.field).inc()
            raise

    def decide(self, req: PlacementRequest) -> Decision:
        """Validate and decide (no writes). InvalidRequest for bad input."""
        started = time.perf_counter()
        self.check(req)
        inv = self.fleet
        inv.expire_hints()
        view = view_for(self.fleet, req)
        rng = random.Random(req.seed) if req.seed else self.rng
        demand = Demand(req.num_nodes, req.mode, req.segment_size)
        outcome = policies.plan(demand, view.index, req.policy, largest_clique=view.largest, rng=rng)
        decision = self._judge(req, demand, view, outcome)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self.metrics.count_decision(
            req.policy.value, decision.reason.value if decision.reason else "feasible"
        )
        return decision

    def _judge(
        self, req: PlacementRequest, demand: Demand, view: View, outcome: PlacementPlan | Infeasible
    ) -> Decision:
        inv = self.fleet
        frag_before = inv.tally.fragmentation()
        block_before = inv.tally.largest_free_block()
        if isinstance(outcome, Infeasible):
            reason, message = outcome.reason, outcome.message
            if reason is not Reason.NO_SINGLE_CLIQUE_FIT:
                sick_view = view.with_sick()
                retry = policies.plan(demand, sick_view, PolicyName.BEST_FIT, largest_clique=view.largest)
                if isinstance(retry, PlacementPlan):
                    sick_cliques = sorted(retry.cliques)
                    reason = Reason.UNHEALTHY_FABRIC
                    message = (
                        f"{message}; it would fit if the nodes with an unhealthy fabric in "
                        f"clique(s) {', '.join(sick_cliques[:4])} were usable"
                    )
            return Decision(
                req.policy, (), 0.0, frag_before, frag_before, block_before, block_before, reason, message
            )
        touched = outcome.cliques
        names = {c: view.names(c) for c in touched}
        segments = policies.pick_nodes(outcome, names)
        free_of = {c: len(names[c]) for c in touched}
        min_cliques = 1 if len(touched) == 1 else policies.min_cliques_needed(view.index.histogram(), demand)
        taken: Counter[str] = Counter()
        for segment in segments:
            taken[segment.clique_id] += len(segment.node_names)
        frag_after, block_after = inv.tally.after_taking(inv.cliques, taken)
        return Decision(
            policy=req.policy,
            segments=segments,
            score=policies.score(outcome, free_of, min_cliques),
            fragmentation_before=frag_before,
            fragmentation_after=frag_after,
            largest_free_block_before=block_before,
            largest_free_block_after=block_after,
        )

    async def place(self, req: PlacementRequest, capped: bool = False) -> Decision:
        """Decide; with reserve=true (and not dry_run) also hold the nodes in the store. `capped`:
        the holder's reserved nodes count against --max-reserved-nodes-per-holder (a client's,
        not the extender's for scheduled pods)."""
        if not req.reserve or req.dry_run:
            return self.decide(req)
        store = self._require_store()
        ttl = req.reservation_ttl_s or self.config.default_ttl_s
        holder = req.holder or self.config.holder
        self._check_holder_cap(holder, req.num_nodes, capped)
        backoff = Backoff(initial=0.002, cap=0.1, jitter=0.5)
        for attempt in range(1, self.config.reserve_attempts + 1):
            decision = self.decide(req)
            if not decision.feasible:
                return decision
            nodes = decision.node_names
            cliques = [s.clique_id for s in decision.segments for _ in s.node_names]
            written = await self._write_held(
                store, nodes, cliques, req.domain_uid, holder, ttl, req.reservation_id or None, attempt, True
            )
            if written is None:
                await asyncio.sleep(backoff.next_delay())
                continue
            return replace(decision, reservation=_info(written))
        self.metrics.reservations.labels("contention").inc()
        raise ReservationContention(
            f"could not reserve {req.num_nodes} node(s): lost {self.config.reserve_attempts} races to concurrent writers"
        )

    async def _write_held(
        self,
        store: Store,
        nodes: Sequence[str],
        cliques: Sequence[str],
        domain_uid: str,
        holder: str,
        ttl: int,
        reservation_id: str | None,
        attempt: int,
        retry_on_conflict: bool,
    ) -> Written | None:
        """Hold the nodes locally, write the reservation; None after a conflict (taken nodes hidden)."""
        inv = self.fleet
        rid = reservation_id or new_reservation_id()
        token = inv.hold(nodes)
        inv.begin_write(rid)
        applied = 0
        try:
            written = await write_reservation(
                store, nodes, cliques, domain_uid, holder, ttl, rid, self.batcher
            )
            # The record is applied before the hold goes, so its nodes never look free in between.
            inv.apply_reservation(rid, written.record, written.revision)
            applied = written.revision
        except ReservationConflict as exc:
            self.metrics.reservations.labels("conflict").inc()
            log.info(
                "reservation conflict; deciding again",
                taken=len(exc.taken),
                attempt=attempt,
                cd_uid=domain_uid or None,
            )
            # Hide the taken nodes before the hold goes, so they never look free in between.
            inv.hint_taken(exc.taken, self.config.hint_seconds)
            inv.release_hold(token)
            if not retry_on_conflict:
                raise
            return None
        except BaseException:
            inv.release_hold(token)
            raise
        finally:
            inv.end_write(rid, applied)
        inv.release_hold(token)
        self.metrics.reservations.labels("created").inc()
        return written

    async def reserve_nodes(
        self,
        nodes: Sequence[str],
        domain_uid: str,
        ttl_s: int,
        holder: str,
        reservation_id: str = "",
        capped: bool = False,
    ) -> ReservationInfo:
        """Reserve explicit nodes. InvalidRequest, NodeUnavailable, ReservationConflict or ReservationExists."""
        inv = self.fleet
        if not nodes:
            raise InvalidRequest("node_names", "at least one node is needed")
        self._check_lengths({"holder": holder, "domain_uid": domain_uid, "reservation_id": reservation_id})
        seen: set[str] = set()
        for i, name in enumerate(nodes):
            self._check_lengths({f"node_names[{i}]": name})
            if name not in inv.nodes:
                raise InvalidRequest(f"node_names[{i}]", f"unknown node {clip(repr(name))}")
            if name in seen:
                raise InvalidRequest(f"node_names[{i}]", f"node {clip(repr(name))} named twice")
            seen.add(name)
        self._check_ttl(ttl_s, "ttl_seconds")
        if "/" in reservation_id:
            raise InvalidRequest("reservation_id", "must not contain '/'")
        if "/" in domain_uid:
            raise InvalidRequest("domain_uid", "must not contain '/'")
        self._check_holder_cap(holder or self.config.holder, len(nodes), capped)
        unusable = [n for n in nodes if not inv.nodes[n].usable]
        if unusable:
            raise NodeUnavailable(f"node(s) not healthy: {', '.join(unusable[:8])}")
        taken = {n: "reserved or bound" for n in nodes if not inv.is_free(n)}
        if taken:
            self.metrics.reservations.labels("conflict").inc()
            raise ReservationConflict(taken)
        store = self._require_store()
        ttl = ttl_s or self.config.default_ttl_s
        try:
            written = await self._write_held(
                store,
                list(nodes),
                [inv.nodes[n].clique for n in nodes],
                domain_uid,
                holder or self.config.holder,
                ttl,
                reservation_id or None,
                1,
                False,
            )
        except ReservationExists:
            self.metrics.reservations.labels("exists").inc()
            raise
        assert written is not None
        return _info(written)

    async def release(self, reservation_id: str, caller: str) -> tuple[bool, list[str]]:
        """Remove the reservation if `caller` holds it ("" = this advisor's default holder, as a
        reservation made without a holder is held); NotHolder, changing nothing, if not."""
        if not reservation_id or "/" in reservation_id:
            raise InvalidRequest("reservation_id", "must be a non-empty id without '/'")
        self._check_lengths({"reservation_id": reservation_id, "holder": caller})
        caller = caller or self.config.holder
        store = self._require_store()
        inv = self.fleet
        record = inv.reservations.get(reservation_id)
        revision = inv.reservation_revision(reservation_id)
        if record is not None and record.holder != caller:
            raise NotHolder(reservation_id, caller)
        if record is not None and revision and fits_one_txn(record.node_names):
            # What this advisor knows of the reservation is enough to remove it in one write.
            removed_at = await remove_in_one_txn(
                store, reservation_id, record.node_names, revision, self.batcher
            )
            if removed_at is not None:
                inv.apply_reservation(reservation_id, None, removed_at)
                self.metrics.reservations.labels("released").inc()
                # Counted in the metrics; at debug level each one (a scheduler releases thousands a second).
                log.debug("reservation released", reservation=reservation_id, nodes=len(record.node_names))
                return True, list(record.node_names)
        removed = await delete_reservation(store, reservation_id, caller)
        if removed is None:
            return False, []
        inv.apply_reservation(reservation_id, None, await store.revision())
        self.metrics.reservations.labels("released").inc()
        return True, list(removed.node_names)

    def _require_store(self) -> Store:
        if self.store is None:
            raise RuntimeError("this advisor has no store: reservations are unavailable")
        return self.store

    def capacity(self, selector: Mapping[str, str] | None = None) -> CapacityReport:
        selector = selector or {}
        self._check_selector(selector)
        self.fleet.expire_hints()
        return capacity_report(self.fleet, selector)

    def explain(self, req: PlacementRequest, limit: int = 5) -> Explanation:
        return explain(req, self.decide(req), view_for(self.fleet, req), limit)


def _info(written: Written) -> ReservationInfo:
    record = written.record
    return ReservationInfo(
        id=record.id,
        node_names=tuple(record.node_names),
        clique_ids=tuple(dict.fromkeys(record.clique_ids)),
        domain_uid=record.domain_uid,
        holder=record.holder,
        ttl_s=int(record.ttl_seconds),
        expires_unix_ms=record.created_unix_ms + int(record.ttl_seconds) * 1000,
    )
