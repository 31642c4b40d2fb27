"""Members whose node lives but whose IMEX links are lost: a partition, not a node loss (pure).

A member whose node record is present (its IMEX agent holds its lease) while the daemons of its
live peers report their link to it DISCONNECTED (up once, lost since: `DaemonStatus
.disconnected_nodes`) is cut off from its peers, not gone: a switch port, a firewall rule, a
cable. Nothing is reconfigured for it; its daemons keep every reference to the peers they cannot
reach until IMEX_NODE_DISCONNECTED_GRACE_TIME runs out (NVIDIA's IMEX guide, "Connections, Quorum,
and Clean up"), so a short cut leaves a running job's imports valid.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.controller.liveness import Liveness, live_peers, live_reports
from services.controller.observed import DomainObservation


@dataclass(frozen=True)
class Unreachable:
    node: str
    lost_by: tuple[str, ...]  # live peers whose daemons lost their link to it, sorted
    peers: int  # live peers it has (who could reach it)

    @property
    def cut_off(self) -> bool:
        """Every live peer lost it: the node itself is cut off, not one link."""
        return len(self.lost_by) == self.peers


def unreachable(obs: DomainObservation, live: Liveness) -> list[Unreachable]:
    """Present fabric members that live peers report DISCONNECTED, most peers first, then by name."""
    lost_by: dict[str, set[str]] = {}
    for reporter, me, daemon in live_reports(obs):
        for name in daemon.disconnected_nodes:
            peer = obs.members.get(name)
            if (
                peer is not None
                and name != reporter
                and peer.clique_id == me.clique_id
                and name not in live.lost
                and obs.node_present(name)
            ):
                lost_by.setdefault(name, set()).add(reporter)
    found = [Unreachable(n, tuple(sorted(by)), len(live_peers(obs, n))) for n, by in lost_by.items()]
    return sorted(found, key=lambda u: (-len(u.lost_by), u.node))
