"""One IMEX daemon's health and restarts, and when it is told to re-resolve (pure state machines).

`DaemonLifecycle` is fed what the shell observed (a start, a failed start, an exit, a probe
answer or silence), each with the time it happened, and says what the status should be and what
to do next (start now / at a time, kill an unresponsive daemon). It reads no clock and does no
I/O, so every path, including the slow ones (backoff caps, stable periods, debounces), is tested
with a fake clock.

* STARTING after a start until the daemon first answers READY (FAILED stays visible until a
  start finally reaches READY, so a crash loop is not hidden behind a hopeful STARTING).
* READY once the probe says so; a READY daemon becomes NOT_READY only after it was not ready
  for ``not_ready_debounce_s`` without a break (a peer's SIGUSR1 reconnect is not worth two
  status writes on every member).
* An exit or a failed start makes it NOT_READY, or FAILED after ``failed_after`` consecutive
  starts that never reached READY; the next start is delayed by a capped exponential backoff
  that starts over when the daemon had been READY for ``stable_after_s`` before it died.
* A daemon that does not answer its probe for ``unresponsive_kill_s`` is to be stopped
  (SIGTERM, SIGKILL after the grace; its exit then restarts it like any other).
* A daemon that cannot run on this node at all (``refused``: e.g. the driver is too old for
  the nodes config) is FAILED with the reason and never started.

`ReloadPolicy` decides when the daemon gets SIGUSR1: only after a slot's address changed, at
most once per ``min_interval_s`` (nvidia-imex ignores a SIGUSR1 within 5 s of the previous one,
IMEX_MINIMUM_SSL_RELOAD_INTERVAL), with the changes in between coalesced into the next one, and
only once the daemon answers (before that its signal handlers may not be installed, and a
starting daemon resolves every name afresh anyway).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from libs.gen.computedomain.state import v1 as pb

STARTING = pb.DaemonState.STARTING
READY = pb.DaemonState.READY
NOT_READY = pb.DaemonState.NOT_READY
FAILED = pb.DaemonState.FAILED


@dataclass(frozen=True)
class LifecyclePolicy:
    """The timing rules of one daemon's supervision (seconds)."""

    not_ready_debounce_s: float = 0.5
    failed_after: int = 3
    restart_backoff_initial_s: float = 0.2
    restart_backoff_cap_s: float = 10.0
    stable_after_s: float = 10.0
    # 0 = never kill a silent daemon.
    unresponsive_kill_s: float = 20.0
    # A start that is not READY after this long names what it waits for in last_error.
    waiting_detail_after_s: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if self.failed_after < 1:
            problems.append("failed_after must be >= 1")
        if not self.restart_backoff_initial_s > 0:
            problems.append("restart_backoff_initial_s must be > 0")
        if not self.restart_backoff_cap_s >= self.restart_backoff_initial_s:
            problems.append("restart_backoff_cap_s must be >= restart_backoff_initial_s")
        for name in (
            "not_ready_debounce_s",
            "stable_after_s",
            "unresponsive_kill_s",
            "waiting_detail_after_s",
        ):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0")
        if problems:
            raise ValueError("invalid daemon lifecycle policy: " + "; ".join(problems))

    def restart_delay(self, attempt: int) -> float:
        """The delay before restart number `attempt` (0-based) since the backoff last reset."""
        return min(self.restart_backoff_cap_s, self.restart_backoff_initial_s * 2.0 ** min(attempt, 64))


class ProbeAction(enum.Enum):
    """What the shell should do after a probe."""

    NOTHING = "nothing"
    # Silent for unresponsive_kill_s: stop it (SIGTERM first, so a daemon that still handles
    # signals stops cleanly and its successor has no recovery to wait for; SIGKILL after the
    # grace). Its exit restarts it.
    STOP = "stop"


@dataclass
class DaemonLifecycle:
    """The health of one domain's daemon on this node, across its restarts."""

    policy: LifecyclePolicy
    state: pb.DaemonState = STARTING
    running: bool = False
    # Starts after the first one (a restart of the IMEX agent that adopts a daemon adds none).
    restarts: int = 0
    # Starts in a row that never reached READY (an exit after READY counts as one).
    consecutive_failures: int = 0
    last_error: str = ""
    # When the next start is due while the daemon is down (the first start: at once).
    next_start_at: float = float("-inf")
    # Loop time of the current process's start (or adoption), when it first answered READY in
    # this run of READY, and since when it has been not ready / silent without a break.
    started_at: float | None = None
    ready_since: float | None = None
    not_ready_since: float | None = None
    silent_since: float | None = None
    ever_ready: bool = False  # the current process reached READY at least once
    answered: bool = False  # the current process answered a probe at least once
    _attempted: bool = False  # some process was started or adopted before
    _backoff_attempt: int = 0

    def start_due(self, now: float) -> bool:
        return not self.running and now >= self.next_start_at

    def started(self, now: float) -> None:
        """A new process was spawned."""
        if self._attempted:
            self.restarts += 1
        self._attempted = True
        self._begin(now)
        if self.state != FAILED:
            self.state = STARTING

    def adopted(self, now: float, counted_restarts: int = 0) -> None:
        """A running process of a previous incarnation of the agent is supervised from now on.

        `counted_restarts` continues the counter the previous incarnation reported."""
        self._attempted = True
        self.restarts = max(self.restarts, counted_restarts)
        self._begin(now)
        self.state = STARTING  # until its first answer says otherwise

    def refused(self, reason: str) -> None:
        """No daemon can run here (nothing to retry until the node changes): FAILED for good."""
        self._attempted = True
        self.running = False
        self.state = FAILED
        self.last_error = reason
        self.next_start_at = float("inf")

    def start_failed(self, now: float, reason: str) -> float:
        """The spawn itself failed (binary missing, log not writable); returns the retry delay."""
        self._attempted = True
        self.running = False
        return self._down(now, reason)

    def exited(self, now: float, reason: str) -> float:
        """The process is gone; returns the delay before the next start."""
        if not self.running:
            return max(0.0, self.next_start_at - now)
        if self.ready_since is not None and now - self.ready_since >= self.policy.stable_after_s:
            self._backoff_attempt = 0  # it ran well: this is a fresh failure, not a crash loop
        if self.ever_ready:
            self.consecutive_failures = 0
        self.running = False
        return self._down(now, reason)

    def replaced(self, now: float) -> None:
        """The process was stopped on purpose to start one with a new identity: start at once,
        no failure counted (the next start still counts as a restart)."""
        self.running = False
        self.next_start_at = now
        if self.state != FAILED:
            self.state = STARTING
        self.started_at = None
        self.ready_since = None
        self.not_ready_since = None
        self.silent_since = None
        self.ever_ready = False
        self.answered = False

    def probed(self, now: float, answered: bool, ready: bool, detail: str = "") -> ProbeAction:
        """The readiness probe's result: `answered` (the daemon replied), `ready` (it is READY)."""
        if not self.running:
            return ProbeAction.NOTHING
        if answered:
            self.answered = True
            self.silent_since = None
        elif self.silent_since is None:
            self.silent_since = now
        if ready:
            self.state = READY
            self.last_error = ""
            self.consecutive_failures = 0
            self.ever_ready = True
            if self.ready_since is None:
                self.ready_since = now
            self.not_ready_since = None
            return ProbeAction.NOTHING
        self.ready_since = None
        kill_after = self.policy.unresponsive_kill_s
        if self.silent_since is not None and kill_after > 0 and now - self.silent_since >= kill_after:
            return ProbeAction.STOP
        if not self.ever_ready:
            if self.state != FAILED:
                self.state = STARTING
            assert self.started_at is not None
            if now - self.started_at >= self.policy.waiting_detail_after_s and detail:
                self.last_error = detail
            return ProbeAction.NOTHING
        if self.not_ready_since is None:
            self.not_ready_since = now
        if self.state == READY and now - self.not_ready_since >= self.policy.not_ready_debounce_s:
            self.state = NOT_READY
            self.last_error = detail or "daemon not ready"
        return ProbeAction.NOTHING

    @property
    def ready(self) -> bool:
        return self.running and self.state == READY

    def not_ready_due_at(self) -> float | None:
        """When a READY daemon that keeps failing its probe turns NOT_READY (for the poll timer)."""
        if self.state != READY or self.not_ready_since is None:
            return None
        return self.not_ready_since + self.policy.not_ready_debounce_s

    def _begin(self, now: float) -> None:
        self.running = True
        self.started_at = now
        self.ready_since = None
        self.not_ready_since = None
        self.silent_since = now  # silent until its first answer: a daemon hung at start is killed too
        self.ever_ready = False
        self.answered = False

    def _down(self, now: float, reason: str) -> float:
        self.consecutive_failures += 1
        self.state = FAILED if self.consecutive_failures >= self.policy.failed_after else NOT_READY
        self.last_error = reason
        delay = self.policy.restart_delay(self._backoff_attempt)
        self._backoff_attempt += 1
        self.next_start_at = now + delay
        self.started_at = None
        self.ready_since = None
        self.not_ready_since = None
        self.silent_since = None
        self.ever_ready = False
        self.answered = False
        return delay


@dataclass
class ReloadPolicy:
    """When to send SIGUSR1: after an address change, at most once per `min_interval_s`.

    With `settle_s` > 0 an owed signal also waits until the slot map has been quiet for
    `settle_s` (but no longer than `settle_max_s` after the first change it covers): a domain
    forming sees a burst of joins, and one signal after the burst reaches every new member,
    where a signal at its first join would leave the rest to the daemon's reconnect backoff
    until the next signal is allowed 5.2 s later.
    """

    min_interval_s: float = 5.2
    settle_s: float = 0.0
    settle_max_s: float = 0.0
    pending: bool = False
    last_sent_at: float | None = None
    first_change_at: float = 0.0
    last_change_at: float = 0.0

    def changed(self, now: float = 0.0) -> None:
        """A slot's address changed (the hosts file was rewritten) at `now`."""
        if not self.pending:
            self.first_change_at = now
        self.last_change_at = now
        self.pending = True

    def daemon_started(self) -> None:
        """A new process resolves every name at start: nothing is owed to it.

        The spacing still counts from the last signal (a new process of the real daemon keeps
        no memory of it, but nothing is lost by waiting, and it keeps the rule simple)."""
        self.pending = False

    def due_at(self) -> float | None:
        """When the owed signal may be sent (None: none is owed)."""
        if not self.pending:
            return None
        due = float("-inf") if self.last_sent_at is None else self.last_sent_at + self.min_interval_s
        if self.settle_s > 0:
            quiet = min(self.last_change_at + self.settle_s, self.first_change_at + self.settle_max_s)
            due = max(due, quiet)
        return due

    def should_send(self, now: float, responsive: bool) -> bool:
        """True (and the signal counted as sent at `now`) when one is owed, allowed and useful."""
        due = self.due_at()
        if due is None or not responsive or now < due:
            return False
        self.pending = False
        self.last_sent_at = now
        return True
