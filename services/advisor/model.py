"""The advisor's own vocabulary: requests, decisions and reasons, free of protobuf.

The gRPC layer and the extender translate into these types; the policies and
the fleet index never see a wire message.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.runtime.errors import PermanentError


class Mode(enum.Enum):
    REQUIRE_SINGLE_CLIQUE = "REQUIRE_SINGLE_CLIQUE"
    PREFER_SINGLE_CLIQUE = "PREFER_SINGLE_CLIQUE"
    ALLOW_SPLIT = "ALLOW_SPLIT"


class PolicyName(enum.Enum):
    BEST_FIT = "BEST_FIT"
    FIRST_FIT = "FIRST_FIT"
    RANDOM = "RANDOM"
    SPREAD = "SPREAD"


class Reason(enum.Enum):
    NO_CAPACITY = "NO_CAPACITY"
    NO_SINGLE_CLIQUE_FIT = "NO_SINGLE_CLIQUE_FIT"
    FRAGMENTED = "FRAGMENTED"
    UNHEALTHY_FABRIC = "UNHEALTHY_FABRIC"


SELECTOR_KEYS = ("name", "clique", "cluster", "rack", "driver_version", "agent_version")
"""Node attributes a selector may match; `rack` is the NVLink domain's cluster UUID (one per NVL72 rack)."""


class InvalidRequest(PermanentError, ValueError):
    """The request itself is wrong (not merely infeasible); `field` names the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    num_nodes: int
    gpus_per_node: int = 0
    mode: Mode = Mode.REQUIRE_SINGLE_CLIQUE
    segment_size: int = 0
    node_selector: Mapping[str, str] = field(default_factory=dict)
    excluded_nodes: frozenset[str] = frozenset()
    # None = every node; otherwise only these (a scheduler's candidate list).
    candidate_nodes: frozenset[str] | None = None
    policy: PolicyName = PolicyName.BEST_FIT
    dry_run: bool = False
    domain_uid: str = ""
    reserve: bool = False
    reservation_ttl_s: int = 0
    holder: str = ""
    seed: int = 0
    # Empty = generated; a fixed id makes a second writer of the same reservation fail (ReservationExists).
    reservation_id: str = ""


@dataclass(frozen=True, slots=True)
class Segment:
    clique_id: str
    node_names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReservationInfo:
    id: str
    node_names: tuple[str, ...]
    clique_ids: tuple[str, ...]
    domain_uid: str
    holder: str
    ttl_s: int
    expires_unix_ms: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a placement request; `segments` is empty when infeasible."""

    policy: PolicyName
    segments: tuple[Segment, ...]
    score: float
    fragmentation_before: float
    fragmentation_after: float
    largest_free_block_before: int
    largest_free_block_after: int
    reason: Reason | None = None
    message: str = ""
    reservation: ReservationInfo | None = None

    @property
    def feasible(self) -> bool:
        return self.reason is None

    @property
    def node_names(self) -> list[str]:
        return [n for s in self.segments for n in s.node_names]


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders rack2-tray10 after rack2-tray9 (numbers compare as numbers)."""
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part) for part in _DIGITS.split(name) if part
    )
