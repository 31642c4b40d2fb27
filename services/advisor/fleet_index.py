"""The advisor's index of the fleet: nodes, bindings and reservations (pure; fed by `fleet_feeds`).

Per clique it keeps the set of free nodes (usable, neither bound to a domain nor
reserved nor held by an in-flight reservation), so a decision reads counts
instead of scanning 10,000 nodes. Fragmentation sums and a histogram of free
counts per clique are kept incrementally for the same reason.

Sources (each a resumable prefix watch that starts with a full listing):
- nodes/<name>         Node records on node-agent leases: clique, health, GPUs
- nodebindings/<name>  NodeBinding: the node is in a domain (the one-domain guard)
- reservations/<id>    Reservation records on TTL leases (ours and other advisors')

A node is usable when its record says HEALTHY, it has a clique and every GPU has
completed fabric registration and is not degraded/unhealthy (with
`healthy_only=False`, DEGRADED nodes are usable too). Usable-but-taken and
unusable-but-untaken nodes are tracked as well: the latter tell "it would fit if
the fabric were healthy" (UNHEALTHY_FABRIC) from "it does not fit".

No I/O and no awaits: the feeds apply what the store says, `advisor.py` applies its own writes,
and waiting for a change is `fleet_feeds.wait_changed` (told through `listeners`). The running
totals over the free sets are `free_tally.FreeTally`; this process's holds and hints are
`local_holds.LocalHolds`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.keys import Keys
from libs.state.watch import WatchEvent, put_event
from services.advisor.free_tally import CliqueEntry, FreeTally
from services.advisor.local_holds import LocalHolds
from services.advisor.model import natural_key
from services.advisor.own_echoes import OwnEchoes

log = structlog.get_logger(__name__)

_BAD_GPU_HEALTH = (pb.Health.DEGRADED, pb.Health.UNHEALTHY)


@dataclass(slots=True)
class NodeEntry:
    name: str
    clique: str
    cluster: str
    usable: bool
    # Has a clique but fails the health check (counts for UNHEALTHY_FABRIC).
    sick: bool
    healthy_gpus: int
    record: pb.Node
    key: tuple[object, ...]


def judge_node(record: pb.Node, healthy_only: bool = True) -> tuple[bool, bool, int]:
    """(usable, sick, healthy GPU count) of a node record."""
    gpus_ok = [
        g
        for g in record.gpus
        if g.fabric_state == pb.FabricState.COMPLETED and g.health not in _BAD_GPU_HEALTH
    ]
    node_ok = record.health == pb.Health.HEALTHY or (not healthy_only and record.health == pb.Health.DEGRADED)
    all_gpus_ok = len(gpus_ok) == len(record.gpus)
    usable = bool(record.clique_id) and node_ok and all_gpus_ok
    sick = bool(record.clique_id) and not usable
    return usable, sick, len(gpus_ok)


class FleetIndex:
    """In-memory index; mutate through `apply_*` / `resync_*` (the store feeds do), read anywhere."""

    def __init__(self, healthy_only: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.healthy_only = healthy_only
        self.clock = clock
        self.nodes: dict[str, NodeEntry] = {}
        self.cliques: dict[str, CliqueEntry] = {}
        self.cliques_by_cluster: dict[str, set[str]] = {}
        # node -> domain uid it is bound to
        self.bound: dict[str, str] = {}
        self.bound_by_domain: dict[str, set[str]] = {}
        # reservation id -> record; node -> reservation id
        self.reservations: dict[str, pb.Reservation] = {}
        self.reserved_by: dict[str, str] = {}
        self.reservations_by_domain: dict[str, set[str]] = {}
        self._reservation_rev: dict[str, int] = {}
        self._reservation_tombstones: dict[str, int] = {}
        self.own_echoes = OwnEchoes()
        # In-flight reservations of this process, and nodes another writer took that our watch
        # has not shown yet.
        self.holds = LocalHolds()
        # Free capacity per clique as policy input, kept current; and the same with
        # unhealthy-but-untaken nodes counted, to recognise UNHEALTHY_FABRIC.
        self.tally = FreeTally()
        self.index = self.tally.index
        self.index_with_sick = self.tally.index_with_sick
        self._usable_gpus: Counter[int] = Counter()
        self._gpu_counts: Counter[int] = Counter()
        self._largest_clique_cache: int | None = None
        # The most nodes one clique has had records at once, ever (records lapse; racks do not shrink).
        self._largest_clique_seen = 0
        self.generation = 0
        # Told after every change (`fleet_feeds.wait_changed` wakes its waiters through this).
        self.listeners: list[Callable[[], None]] = []
        self.reservation_watch_revision = 0
        self.synced: set[str] = set()
        # Told the uid of every domain whose bindings or reservations changed (the reaper).
        self.on_domain_change: Callable[[str], None] | None = None

    def _bump(self) -> None:
        self.generation += 1
        for listener in self.listeners:
            listener()

    def _available(self, name: str) -> bool:
        return name not in self.bound and name not in self.reserved_by and name not in self.holds

    def _refresh(self, name: str, force: bool = False) -> None:
        clique = self._resort(name)
        if clique is not None:
            self.tally.retally(clique)
        elif force:
            entry = self.nodes.get(name)
            clique = self.cliques.get(entry.clique) if entry is not None else None
            if clique is not None:
                self.tally.retally(clique)

    def _refresh_all(self, names: Iterable[str]) -> None:
        """`_refresh` for many nodes, each changed clique's tallies redone once (a decision's
        hold, reservation and release touch all its nodes, mostly in one or two cliques)."""
        changed: dict[str, CliqueEntry] = {}
        for name in names:
            clique = self._resort(name)
            if clique is not None:
                changed[clique.clique_id] = clique
        for clique in changed.values():
            self.tally.retally(clique)

    def _resort(self, name: str) -> CliqueEntry | None:
        """Put the node in or out of its clique's free sets; the clique if they changed."""
        entry = self.nodes.get(name)
        if entry is None:
            return None
        clique = self.cliques.get(entry.clique)
        if clique is None:
            return None
        available = self._available(name)
        changed = False
        if (entry.usable and available) != (name in clique.free):
            if entry.usable and available:
                clique.free.add(name)
            else:
                clique.free.discard(name)
            clique.free_sorted = None
            changed = True
        if (entry.sick and available) != (name in clique.sick_free):
            if entry.sick and available:
                clique.sick_free.add(name)
            else:
                clique.sick_free.discard(name)
            changed = True
        return clique if changed else None

    def _remove_node(self, name: str) -> None:
        entry = self.nodes.pop(name, None)
        if entry is None:
            return
        self._gpu_counts[len(entry.record.gpus)] -= 1
        if self._gpu_counts[len(entry.record.gpus)] <= 0:
            del self._gpu_counts[len(entry.record.gpus)]
        if entry.usable:
            self._usable_gpus[entry.healthy_gpus] -= 1
            if self._usable_gpus[entry.healthy_gpus] <= 0:
                del self._usable_gpus[entry.healthy_gpus]
        clique = self.cliques.get(entry.clique)
        if clique is None:
            return
        clique.nodes.discard(name)
        clique.free.discard(name)
        clique.free_sorted = None
        clique.sick_free.discard(name)
        self._largest_clique_cache = None
        if not clique.nodes:
            self.tally.retally(clique)
            del self.cliques[entry.clique]
            members = self.cliques_by_cluster.get(clique.cluster)
            if members is not None:
                members.discard(entry.clique)
                if not members:
                    del self.cliques_by_cluster[clique.cluster]
            self.tally.forget(entry.clique)
        else:
            clique.rank = min((self.nodes[n].key for n in clique.nodes), default=())
            self.tally.retally(clique)

    def apply_node(self, name: str, record: pb.Node | None) -> None:
        """A node record appeared, changed (None: vanished, e.g. its agent's lease expired)."""
        if record is None:
            if name in self.nodes:
                self._remove_node(name)
                self._bump()
            return
        old = self.nodes.get(name)
        usable, sick, healthy_gpus = judge_node(record, self.healthy_only)
        if (
            old is not None
            and len(old.record.gpus) == len(record.gpus)
            and old.clique == record.clique_id
            and old.usable == usable
            and old.sick == sick
            and old.healthy_gpus == healthy_gpus
        ):
            old.record = record
            return
        if old is not None:
            self._remove_node(name)
        entry = NodeEntry(
            name=name,
            clique=record.clique_id,
            cluster=record.cluster_uuid,
            usable=usable,
            sick=sick,
            healthy_gpus=healthy_gpus,
            record=record,
            key=natural_key(name),
        )
        self.nodes[name] = entry
        self._gpu_counts[len(record.gpus)] += 1
        if usable:
            self._usable_gpus[healthy_gpus] += 1
        if entry.clique:
            clique = self.cliques.get(entry.clique)
            if clique is None:
                clique = CliqueEntry(entry.clique, entry.cluster, rank=entry.key)
                self.cliques[entry.clique] = clique
                self.cliques_by_cluster.setdefault(entry.cluster, set()).add(entry.clique)
            clique.nodes.add(name)
            self._largest_clique_seen = max(self._largest_clique_seen, len(clique.nodes))
            if entry.key < clique.rank:
                clique.rank = entry.key
            self._largest_clique_cache = None
            self._refresh(name, force=True)
        self._bump()

    def resync_nodes(self, items: Iterable[tuple[str, pb.Node]]) -> None:
        fresh = dict(items)
        for name in [n for n in self.nodes if n not in fresh]:
            self._remove_node(name)
        for name, record in fresh.items():
            self.apply_node(name, record)
        self._bump()

    def apply_binding(self, node: str, domain_uid: str | None) -> None:
        old = self.bound.get(node)
        if old == domain_uid:
            return
        if old is not None:
            members = self.bound_by_domain.get(old)
            if members is not None:
                members.discard(node)
                if not members:
                    del self.bound_by_domain[old]
            del self.bound[node]
        if domain_uid is not None:
            self.bound[node] = domain_uid
            self.bound_by_domain.setdefault(domain_uid, set()).add(node)
            self.holds.drop_hint(node)
        self._refresh(node)
        self._bump()
        if self.on_domain_change is not None:
            for uid in (old, domain_uid):
                if uid:
                    self.on_domain_change(uid)

    def resync_bindings(self, items: Iterable[tuple[str, str]]) -> None:
        fresh = dict(items)
        for node in [n for n in self.bound if n not in fresh]:
            self.apply_binding(node, None)
        for node, uid in fresh.items():
            self.apply_binding(node, uid)
        self._bump()

    def apply_reservation(self, reservation_id: str, record: pb.Reservation | None, revision: int) -> None:
        """A reservation appeared or vanished at `revision`; older news than what we hold is ignored.

        The advisor applies its own reservations right after the write succeeds,
        before the watch reports them; the revision check keeps a late watch event
        about an earlier reservation of the same id from undoing that.
        """
        known = max(
            self._reservation_rev.get(reservation_id, 0), self._reservation_tombstones.get(reservation_id, 0)
        )
        if revision and revision < known:
            return
        if revision and revision == known and (record is not None) == (reservation_id in self.reservations):
            return  # the watch's echo of what this advisor applied when it wrote (or removed) it
        old = self.reservations.pop(reservation_id, None)
        touched: set[str] = set()
        if old is not None:
            for node in old.node_names:
                if self.reserved_by.get(node) == reservation_id:
                    del self.reserved_by[node]
                    touched.add(node)
            ids = self.reservations_by_domain.get(old.domain_uid)
            if ids is not None:
                ids.discard(reservation_id)
                if not ids:
                    del self.reservations_by_domain[old.domain_uid]
        if record is None:
            self._reservation_rev.pop(reservation_id, None)
            self._reservation_tombstones[reservation_id] = revision
        else:
            self.reservations[reservation_id] = record
            self._reservation_rev[reservation_id] = revision
            self._reservation_tombstones.pop(reservation_id, None)
            for node in record.node_names:
                self.reserved_by[node] = reservation_id
                self.holds.drop_hint(node)
                touched.add(node)
            self.reservations_by_domain.setdefault(record.domain_uid, set()).add(reservation_id)
        self._refresh_all(touched)
        if old is not None or record is not None:
            self._bump()
        if self.on_domain_change is not None:
            for uid in {old.domain_uid if old else "", record.domain_uid if record else ""}:
                if uid:
                    self.on_domain_change(uid)

    def reservation_revision(self, reservation_id: str) -> int:
        """The revision at which the reservation's record was written, as far as we know (0: unknown)."""
        return self._reservation_rev.get(reservation_id, 0)

    def resync_reservations(self, items: Iterable[tuple[str, pb.Reservation, int]], revision: int) -> None:
        fresh = {rid: (record, rev) for rid, record, rev in items}
        for rid in [r for r in self.reservations if r not in fresh]:
            if self._reservation_rev.get(rid, 0) <= revision:
                self.apply_reservation(rid, None, revision)
        for rid, (record, rev) in fresh.items():
            self.apply_reservation(rid, record, rev)
        self._prune_tombstones(revision)
        self._bump()

    def _prune_tombstones(self, watch_revision: int) -> None:
        """Tombstones only guard against a watch that lags behind a local apply."""
        self.reservation_watch_revision = max(self.reservation_watch_revision, watch_revision)
        stale = [
            rid for rid, rev in self._reservation_tombstones.items() if rev <= self.reservation_watch_revision
        ]
        for rid in stale:
            del self._reservation_tombstones[rid]

    def hold(self, nodes: Iterable[str]) -> int:
        """Take nodes out of the free sets while this process writes their reservation."""
        names = list(nodes)
        token = self.holds.hold(names)
        self._refresh_all(names)
        self._bump()
        return token

    def release_hold(self, token: int) -> None:
        self._refresh_all(self.holds.release(token))
        self._bump()

    def hint_taken(self, nodes: Iterable[str], seconds: float) -> None:
        """Another writer took these nodes; hide them until our watch shows it (or `seconds` pass)."""
        names = list(nodes)
        self.holds.hint(names, self.clock() + seconds)
        self._refresh_all(names)
        self._bump()

    def expire_hints(self) -> None:
        if not self.holds.hints_pending:
            return
        expired = self.holds.expire(self.clock())
        for name in expired:
            self._refresh(name)
        if expired:
            self._bump()

    def largest_clique(self) -> int:
        if self._largest_clique_cache is None:
            self._largest_clique_cache = max((len(c.nodes) for c in self.cliques.values()), default=0)
        return self._largest_clique_cache

    def largest_clique_seen(self) -> int:
        """The most nodes one clique has had records at once since this inventory began: a node
        whose record lapsed for a while (its agent's lease) still belongs to its clique."""
        return self._largest_clique_seen

    def min_usable_gpus(self) -> int:
        return min(self._usable_gpus, default=0)

    def max_gpus(self) -> int:
        return max(self._gpu_counts, default=0)

    def sorted_free(self, clique_id: str) -> list[str]:
        """The clique's free nodes in node order (a shared list: do not modify it)."""
        clique = self.cliques[clique_id]
        if clique.free_sorted is None:
            nodes = self.nodes
            clique.free_sorted = sorted(clique.free, key=lambda n: nodes[n].key)
        return clique.free_sorted

    def is_free(self, name: str) -> bool:
        entry = self.nodes.get(name)
        return entry is not None and entry.usable and self._available(name)

    def domain_nodes(self, domain_uid: str) -> set[str]:
        """Nodes reserved for or bound to the domain."""
        out = set(self.bound_by_domain.get(domain_uid, ()))
        for rid in self.reservations_by_domain.get(domain_uid, ()):
            out.update(self.reservations[rid].node_names)
        return out

    def domain_reservations(self, domain_uid: str) -> list[pb.Reservation]:
        return [self.reservations[rid] for rid in sorted(self.reservations_by_domain.get(domain_uid, ()))]

    def node_attribute(self, name: str, key: str) -> str:
        entry = self.nodes[name]
        record = entry.record
        if key == "name":
            return name
        if key == "clique":
            return entry.clique
        if key in ("cluster", "rack"):
            return entry.cluster
        if key == "driver_version":
            return record.driver_version
        if key == "agent_version":
            return record.agent_version
        raise KeyError(key)

    @property
    def ready(self) -> bool:
        return {"nodes", "bindings", "reservations"} <= self.synced

    def begin_write(self, reservation_id: str) -> None:
        """This process starts writing the reservation: its watch echo is held back (`own_echoes`)."""
        self.own_echoes.begin(reservation_id)

    def end_write(self, reservation_id: str, applied_revision: int) -> None:
        """The write is over; the writer applied the record written at `applied_revision` (0:
        nothing). An echo held back for any other revision is applied now."""
        echo = self.own_echoes.end(reservation_id, applied_revision)
        if echo is not None:
            self.apply_reservation_event(put_event(echo.key, echo.revision, echo.value, pb.Reservation))

    def skips_reservation_put(self, key: str, revision: int, value: bytes) -> bool:
        """The watch's put of a reservation record, before it is decoded: True when the watch may
        skip it (this process holds that record already, or holds the echo back while writing it)."""
        rid = Keys.last_segment(key)
        if self._reservation_rev.get(rid) == revision and rid in self.reservations:
            return True
        return self.own_echoes.hold(rid, key, revision, value)

    def apply_reservation_event(self, event: WatchEvent[pb.Reservation]) -> None:
        rid = Keys.last_segment(event.key)
        if event.value is None:
            self.own_echoes.deleted(rid)
        self.apply_reservation(rid, event.value, event.revision)
        if len(self._reservation_tombstones) > 256:
            self._prune_tombstones(event.revision)


def free_names_view(fleet: FleetIndex, cliques: Iterable[str]) -> Mapping[str, list[str]]:
    """Sorted free node names of the given cliques (policy `pick_nodes` input)."""
    return {c: fleet.sorted_free(c) for c in cliques}
