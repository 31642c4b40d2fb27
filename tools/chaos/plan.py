"""The soak's decisions, drawn from one seeded `random.Random` (pure).

Every step draws the same number of values whatever the cluster looks like, so one seed always
gives the same sequence of actions, sizes, namespaces and outage lengths (the first fault steps go
through every kind of fault once, in a seeded order; a kind that found no target is tried again
at the next fault step, the one place where the cluster's answers steer the sequence). Targets that depend on
the cluster (which job, which node with a daemon) are chosen with pre-drawn fractions (`pick`), so
a replay picks the same position in the same sorted list.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

JOB_SUBMIT = "submit"
JOB_DELETE = "delete"
KILL_AGENT = "kill-agent"  # the kubelet plugin only: running jobs must not notice
KILL_IMEX_AGENT = "kill-imex-agent"  # its daemons keep running and are adopted
IMEX_CRASH = "imex-crash"
IMEX_HANG = "imex-hang"
IMEX_KILL = "imex-kill"
CONTROLLER_FAILOVER = "controller-failover"
ETCD_RESTART = "etcd-restart"
KILL_NODE = "kill-node"  # plugin, IMEX agent and daemons die; back later with its old index
PARTITION_ETCD = "partition-etcd"  # the node's programs cut off etcd; daemons and peer links stay
CUT_LINKS = "cut-links"  # the node's IMEX links cut both ways, shorter than the grace time
CORRUPT_CHECKPOINT = "corrupt-checkpoint"
UNDECODABLE_VALUE = "undecodable-value"

JOB_ACTIONS = (JOB_SUBMIT, JOB_DELETE)
# Faults that may legitimately break the imports of a job with a member on the node they hit: the
# daemon that exported the memory is gone (a new instance replaces it). Every other fault must
# leave a running job's imports valid (invariant 6).
BREAKS_IMPORTS = frozenset({KILL_NODE, IMEX_CRASH, IMEX_HANG, IMEX_KILL})
FAULTS = (
    KILL_AGENT,
    KILL_IMEX_AGENT,
    IMEX_CRASH,
    IMEX_HANG,
    IMEX_KILL,
    CONTROLLER_FAILOVER,
    ETCD_RESTART,
    KILL_NODE,
    PARTITION_ETCD,
    CUT_LINKS,
    CORRUPT_CHECKPOINT,
    UNDECODABLE_VALUE,
)

DEFAULT_WEIGHTS: Mapping[str, float] = {
    JOB_SUBMIT: 8.0,
    JOB_DELETE: 6.0,
    KILL_AGENT: 3.0,
    KILL_IMEX_AGENT: 2.0,
    IMEX_CRASH: 2.0,
    IMEX_HANG: 1.0,
    IMEX_KILL: 1.0,
    CONTROLLER_FAILOVER: 1.0,
    ETCD_RESTART: 0.7,
    KILL_NODE: 1.0,
    PARTITION_ETCD: 1.5,
    CUT_LINKS: 1.5,
    CORRUPT_CHECKPOINT: 1.0,
    UNDECODABLE_VALUE: 1.0,
}

# Job sizes 1-18 (one NVL72 clique at most), small ones more often so several jobs share a rack.
JOB_SIZES = (1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 6, 6, 7, 8, 9, 10, 12, 14, 16, 18)
NAMESPACES = ("team-a", "team-b", "ml-prod", "research", "default")
ALL_CHANNELS_SHARE = 0.25


@dataclass(frozen=True)
class Step:
    """One decision of the soak."""

    number: int
    delay_s: float  # pause before the action
    action: str
    # Fractions in [0, 1) for choosing targets from lists only known at run time.
    picks: tuple[float, float, float]
    job_size: int
    namespace: str
    all_channels: bool
    # Fraction in [0, 1) that scales variable lengths (outages around the node record's lease TTL).
    length: float
    # A coin for faults with two forms (IMEX agent: SIGKILL or SIGSTOP past its lease).
    coin: bool


def pick(items: Sequence[T], fraction: float) -> T | None:
    """The item at `fraction` of a (sorted) list; None for an empty list."""
    if not items:
        return None
    return items[min(int(fraction * len(items)), len(items) - 1)]


class Plan:
    def __init__(
        self,
        seed: int,
        weights: Mapping[str, float] = DEFAULT_WEIGHTS,
        step_delay_s: tuple[float, float] = (0.4, 2.0),
        quiesce_every: tuple[int, int] = (60, 110),
        faults: Sequence[str] = FAULTS,
    ) -> None:
        """`faults`: the fault kinds this soak knows (another soak, e.g. tools.chaoskube's, has
        its own); every one with a positive weight is done once early on."""
        self.faults = tuple(faults)
        unknown = set(weights) - set(JOB_ACTIONS) - set(self.faults)
        if unknown:
            raise ValueError(f"unknown actions in weights: {sorted(unknown)}")
        if not any(w > 0 for w in weights.values()):
            raise ValueError("at least one action needs a positive weight")
        self.rng = random.Random(seed)
        self.actions = tuple(a for a in (*JOB_ACTIONS, *self.faults) if weights.get(a, 0.0) > 0)
        self.weights = tuple(weights[a] for a in self.actions)
        self.step_delay_s = step_delay_s
        self.quiesce_every = quiesce_every
        self._number = 0
        # Every fault early on, in a seeded order: a short run still tries each kind at least once.
        self._uncovered = [a for a in self.faults if a in self.actions]
        self.rng.shuffle(self._uncovered)

    def next_step(self) -> Step:
        r = self.rng
        self._number += 1
        # Always the same draws, in the same order: the sequence depends on the seed alone.
        delay = r.uniform(*self.step_delay_s)
        action = r.choices(self.actions, weights=self.weights)[0]
        picks = (r.random(), r.random(), r.random())
        size = r.choice(JOB_SIZES)
        namespace = r.choice(NAMESPACES)
        all_channels = r.random() < ALL_CHANNELS_SHARE
        length = r.random()
        coin = r.random() < 0.5
        if action in self.faults and self._uncovered:
            action = self._uncovered.pop(0)
        return Step(self._number, delay, action, picks, size, namespace, all_channels, length, coin)

    def not_done(self, action: str) -> None:
        """A fault found no target before it was ever done: try it again at the next fault step."""
        if action in self.faults and action not in self._uncovered:
            self._uncovered.append(action)

    def steps_until_quiescence(self) -> int:
        return self.rng.randint(*self.quiesce_every)
