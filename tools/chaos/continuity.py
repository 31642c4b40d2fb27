"""Invariant 6 of the soak, the bookkeeping (pure): running jobs keep their imports.

After a job's domain is Ready its workload imports memory between all of its members
(`tools.cdsim.workload`). Those imports stay valid as long as every exporting daemon is the same
instance, so the only faults allowed to break them are the ones that replace a daemon of one of
the job's nodes: the node killed, or its IMEX daemon crashed, hung (and replaced) or killed
(`plan.BREAKS_IMPORTS`). Every other fault (a kubelet plugin or IMEX agent killed or frozen, etcd
restarted or cut off, a controller failover, garbage in the store) must leave them valid.

The ledger keeps every fault of the first kind with the node it hit and the time it was under way.
A job is *armed* from the moment its imports may have been made (its submission, or a later
re-import once everything was quiet); a ledger fault on one of its nodes that was still under way
at or after that moment exempts it. A job that is armed and not exempt must have intact imports.

A node killed while it was a member keeps its index (its member is LOST, not released) and must
take the same index again when it returns: `IndexExpectation` records what it held.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from libs.gen.computedomain.state import v1 as pb
from tools.cdsim.workload import ImportReport

INTACT = "intact"
INCONCLUSIVE = "inconclusive"
BROKEN = "broken"
# What tools.cdsim.workload.judge says of a daemon that did not answer: on a busy machine, or while
# a fault of another node slows everything, a timeout says nothing about the imports themselves.
_UNREACHABLE = "IMEX daemon not reachable"


@dataclass
class NodeFault:
    node: str
    kind: str
    began_s: float
    ended_s: float | None = None  # None: still under way

    def under_way_since(self, since_s: float) -> bool:
        """Was this fault (still) under way at or after `since_s`?"""
        return (math.inf if self.ended_s is None else self.ended_s) >= since_s

    def describe(self) -> str:
        return f"{self.kind} on {self.node} at {self.began_s:.1f}s"


@dataclass
class FaultLedger:
    """Faults that may break the imports of jobs on the node they hit, in the order they began."""

    faults: list[NodeFault] = field(default_factory=list)

    def begin(self, node: str, kind: str, at_s: float) -> NodeFault:
        fault = NodeFault(node, kind, at_s)
        self.faults.append(fault)
        return fault

    @staticmethod
    def end(fault: NodeFault, at_s: float) -> None:
        fault.ended_s = max(at_s, fault.began_s)

    def exempting(self, nodes: Collection[str], armed_s: float) -> NodeFault | None:
        """The first fault that hit one of `nodes` while a job armed at `armed_s` ran; None if none."""
        for fault in self.faults:
            if fault.node in nodes and fault.under_way_since(armed_s):
                return fault
        return None


def verdict(report: ImportReport) -> str:
    """INTACT, BROKEN (an import is invalid or missing), or INCONCLUSIVE (only silent daemons)."""
    if report.intact:
        return INTACT
    if report.problems and all(_UNREACHABLE in problem for problem in report.problems):
        return INCONCLUSIVE
    return BROKEN


def broken_imports(job: str, report: ImportReport, armed_s: float) -> str:
    problems = "; ".join(report.problems) or "no import recorded"
    return (
        f"inv6: job {job} lost imports without a fault that kills one of its daemons "
        f"({report.valid}/{report.expected} valid, armed at {armed_s:.1f}s): {problems}"
    )


@dataclass(frozen=True)
class IndexExpectation:
    """A killed member node must come back to its domain with the index it held."""

    domain_uid: str
    node: str
    index: int
    job: str  # for the message
    old_instance: str  # of its daemon when it was killed ("" if it had none): a new one is its return

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain_uid, self.node)


def index_findings(
    expected: Iterable[IndexExpectation],
    members: Mapping[tuple[str, str], pb.Member],
    daemons: Mapping[tuple[str, str], pb.DaemonStatus],
    live_domains: Collection[str],
    quiescent: bool,
) -> tuple[list[str], list[IndexExpectation]]:
    """(violations, expectations met or moot) for one consistent read of members and daemons.

    A member of the domain on that node with another index is a violation at any time (an index
    never changes while the member exists). The node is back in the domain once a new daemon
    instance of it is READY there: then its member must be ACTIVE with the old index and the
    daemon must have identified itself as that node ID. At quiescence it must be back. Expectations
    of domains that are gone are moot.
    """
    violations: list[str] = []
    settled: list[IndexExpectation] = []
    for e in expected:
        if e.domain_uid not in live_domains:
            settled.append(e)
            continue
        member = members.get(e.key)
        daemon = daemons.get(e.key)
        back = (
            daemon is not None
            and daemon.state == pb.DaemonState.READY
            and bool(daemon.instance)
            and daemon.instance != e.old_instance
        )
        if member is not None and member.index != e.index:
            violations.append(
                f"inv6: {e.node} came back to the domain of job {e.job} with index {member.index}; "
                f"it held index {e.index} when it was killed"
            )
        elif back and member is not None and member.state == pb.MemberState.ACTIVE:
            assert daemon is not None
            if daemon.node_id != e.index:
                violations.append(
                    f"inv6: the new IMEX daemon of {e.node} in the domain of job {e.job} identified "
                    f"itself as node ID {daemon.node_id}; its member holds index {e.index}"
                )
            else:
                settled.append(e)
        elif quiescent:
            state = "no member record" if member is None else pb.MemberState(member.state).name
            running = "a new daemon READY" if back else "no new daemon READY"
            violations.append(
                f"inv6: {e.node} did not take its index {e.index} in the domain of job {e.job} "
                f"back after it was killed ({state}, {running})"
            )
    return violations, settled
