"""The store changes the controller's core can ask for, as plain values.

The pure core (`membership.py`, `teardown.py`) returns these; the reconciler
(`reconciler.py`) applies each as one fenced etcd transaction, so a deposed
leader's late action fails instead of landing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkMemberLost:
    """The node's record is gone (lease expired): member LOST, index freed, binding kept."""

    node: str


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


Action = MarkMemberLost | ReleaseMember | DeletePreparation | DeleteDaemonStatus | DeleteDomain
