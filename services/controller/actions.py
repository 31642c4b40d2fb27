"""The store changes the controller's core can ask for, as plain values.

The pure core (`membership_decisions.py`, `teardown.py`) returns these; the reconciler
(`reconciler.py`) applies each as one fenced etcd transaction, so a deposed
leader's late action fails instead of landing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkMemberLost:
    """The node is gone: member LOST, keeping its index, claim and binding.

    Decided because its node record is absent and no live peer's daemon reports it
    connected; `peer_reports` are those peers' daemon statuses as read ((node, mod revision),
    0 for none), compared unchanged so that a report arriving meanwhile cancels the decision.
    """

    node: str
    peer_reports: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ActivateMember:
    """Member ACTIVE at its own index with its node record's address.

    A LOST member whose node is back (and holds claims of the domain), or an active one
    whose node record shows a new address. Compares the member at `mod_revision`, the node
    record's presence and, for a lost member, that one of `claims` (the prepared claims of
    the domain seen on the node) is still there: the watches of preparations and node records
    are separate streams, and a member made active without claims would never be released.
    """

    node: str
    mod_revision: int
    why: str
    claims: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReleaseMember:
    """Remove a member with its binding (if it points here), index claim and daemon status."""

    node: str
    clique_id: str
    index: int
    mod_revision: int
    why: str
    # An orphan (its domain record is absent): the release also checks that the domain is still
    # absent, so a domain whose record the watch has not delivered yet keeps its members.
    orphan: bool = False


@dataclass(frozen=True, slots=True)
class DeletePreparation:
    """Drop a prepared-claim record left by a node that is gone, so teardown can finish."""

    node: str
    claim_uid: str


@dataclass(frozen=True, slots=True)
class DeleteDaemonStatus:
    """Drop a daemon status of a node that is not a member (stale report)."""

    node: str


@dataclass(frozen=True, slots=True)
class DeleteDomain:
    """Last teardown step: the domain record and every per-domain prefix, in one transaction."""

    domain_revision: int


@dataclass(frozen=True, slots=True)
class SecureMesh:
    """Record the domain's mesh mode (the controller's setting, once) and, for mutual TLS, mint
    its CA; compares the domain record at `domain_revision` and that no CA exists yet."""

    domain_revision: int
    mutual_tls: bool


@dataclass(frozen=True, slots=True)
class SignMeshCertificate:
    """Sign `node`'s request (as read at `request_revision`) for its slot and address."""

    node: str
    request_revision: int
    member_revision: int


@dataclass(frozen=True, slots=True)
class DeleteMeshCredentials:
    """Drop the request and certificate of a node that is not a member (left, or orphaned)."""

    node: str


Action = (
    MarkMemberLost
    | ActivateMember
    | ReleaseMember
    | DeletePreparation
    | DeleteDaemonStatus
    | DeleteDomain
    | SecureMesh
    | SignMeshCertificate
    | DeleteMeshCredentials
)
