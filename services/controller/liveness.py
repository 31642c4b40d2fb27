"""Which members are gone, and whose daemons have their whole clique connected (pure).

A node record (`nodes/<node>`) lives on its IMEX side's lease, so its absence
says that side stopped refreshing: the node died, or only that program did.
The peers' daemons tell the two apart: a daemon that still has its link to
the node up reports it in `DaemonStatus.connected_nodes`. A member is lost
when its record is absent and no live peer (an active member of its clique
whose own record is present, so whose report is current) lists it. A
member alone in its clique has no peer to ask: its record decides.

That test, made on the current reports, is `gone`: the one answer to "may
the controller act as if this node were dead". The loss decision marks the
gone members LOST; the teardown drops prepared claims only of gone nodes. A
LOST mark is history, not that answer: a member marked while its only peer
was itself LOST is reported connected again once that peer is back, and a
node a live peer reaches may still run the job, so its claims must stay.

The same reports decide readiness: a fabric member is ready when its daemon
is READY and connected to every other active fabric member of its clique.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord


@dataclass(frozen=True)
class Liveness:
    # Members gone now: no node record and no live peer reporting them (marked LOST or not).
    gone: frozenset[str]
    # Members lost: marked LOST, or gone (what the status shows and the mesh leaves out).
    lost: frozenset[str]
    # Active fabric members by clique (index >= 0, not lost): whom each daemon must reach.
    mesh: Mapping[str, frozenset[str]]
    # LOST fabric members whose record is back: their reports count once they are ACTIVE again.
    returning: frozenset[str]

    def missing_peers(self, obs: DomainObservation, name: str) -> list[str]:
        """Active fabric peers of `name` its daemon does not report connected, sorted."""
        member = obs.members[name]
        daemon = obs.daemons.get(name)
        connected = daemon.connected_nodes if daemon is not None else frozenset()
        return sorted(p for p in self.mesh.get(member.clique_id, ()) if p != name and p not in connected)


def live_reporter(obs: DomainObservation, name: str, member: MemberRecord) -> bool:
    """Its daemon's report counts: an active fabric member whose node record is present."""
    return member.fabric and not member.lost and obs.node_present(name)


def live_peers(obs: DomainObservation, name: str) -> list[str]:
    """The live reporters of `name`'s clique (other than itself): who could vouch for it."""
    member = obs.members[name]
    if not member.fabric:
        return []
    return sorted(
        p
        for p, m in obs.members.items()
        if p != name and m.clique_id == member.clique_id and live_reporter(obs, p, m)
    )


def live_reports(obs: DomainObservation) -> Iterator[tuple[str, MemberRecord, DaemonRecord]]:
    """(reporter, its member record, its daemon status) of every live reporter."""
    for reporter, daemon in obs.daemons.items():
        me = obs.members.get(reporter)
        if me is not None and live_reporter(obs, reporter, me):
            yield reporter, me, daemon


def vouched_for(obs: DomainObservation) -> dict[str, set[str]]:
    """Member -> the live peers of its clique whose daemons report it connected."""
    out: dict[str, set[str]] = {}
    for reporter, me, daemon in live_reports(obs):
        for name in daemon.connected_nodes:
            peer = obs.members.get(name)
            if peer is not None and name != reporter and peer.clique_id == me.clique_id:
                out.setdefault(name, set()).add(reporter)
    return out


def liveness(obs: DomainObservation) -> Liveness:
    vouched = vouched_for(obs)
    gone = frozenset(n for n in obs.members if not obs.node_present(n) and not vouched.get(n))
    lost = gone | {n for n, m in obs.members.items() if m.lost}
    returning = frozenset(
        n for n, m in obs.members.items() if m.lost and m.fabric and m.index >= 0 and obs.node_present(n)
    )
    mesh: dict[str, set[str]] = {}
    for name, m in obs.members.items():
        if m.fabric and m.index >= 0 and name not in lost:
            mesh.setdefault(m.clique_id, set()).add(name)
    return Liveness(gone, lost, {clique: frozenset(names) for clique, names in mesh.items()}, returning)
