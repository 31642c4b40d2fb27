"""The pure daemon lifecycle and SIGUSR1 policy, driven by a fake clock.

Stateful property tests: hypothesis plays any sequence of starts, failed starts, exits, probe
answers, silences and identity replacements at arbitrary times, and after every step the machine
must say what a user of the status would expect (READY only while running and answering ready,
NOT_READY only after the debounce, FAILED exactly after `failed_after` starts in a row that never
got READY, restart delays within the backoff and back to the initial one after a stable run, a
silent daemon killed exactly when it has been silent long enough). The SIGUSR1 policy: never two
signals closer than the minimum interval, none without a change, and none owed for long.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.imexagent.daemon_lifecycle import (
    FAILED,
    NOT_READY,
    READY,
    STARTING,
    DaemonLifecycle,
    LifecyclePolicy,
    ProbeAction,
    ReloadPolicy,
)

POLICY = LifecyclePolicy(
    not_ready_debounce_s=0.5,
    failed_after=3,
    restart_backoff_initial_s=0.2,
    restart_backoff_cap_s=3.0,
    stable_after_s=10.0,
    unresponsive_kill_s=20.0,
    waiting_detail_after_s=5.0,
)

steps = st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 12.0, 25.0])


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.lc = DaemonLifecycle(POLICY)
        # The model: what a careful reader of the rules expects.
        self.attempted = False
        self.expected_restarts = 0
        self.failures = 0  # starts in a row that never got READY
        self.ever_ready = False
        self.ready_since: float | None = None
        self.not_ready_since: float | None = None
        self.silent_since: float | None = None
        self.backoff_attempt = 0
        self.last_action = ProbeAction.NOTHING

    # ---- time -------------------------------------------------------------------------

    @rule(dt=steps)
    def advance(self, dt: float) -> None:
        self.now += dt

    # ---- process events ---------------------------------------------------------------

    @precondition(lambda self: not self.lc.running)
    @rule()
    def start(self) -> None:
        if not self.lc.start_due(self.now):
            assert self.now < self.lc.next_start_at
            return
        before = self.lc.state
        self.lc.started(self.now)
        if self.attempted:
            self.expected_restarts += 1
        self.attempted = True
        self._begin()
        assert self.lc.state == (FAILED if before == FAILED else STARTING)

    @precondition(lambda self: not self.lc.running)
    @rule()
    def start_fails(self) -> None:
        if not self.lc.start_due(self.now):
            return
        self.attempted = True
        delay = self.lc.start_failed(self.now, "cannot start")
        self._down(delay)

    @precondition(lambda self: self.lc.running)
    @rule()
    def exits(self) -> None:
        stable = self.ready_since is not None and self.now - self.ready_since >= POLICY.stable_after_s
        if stable:
            self.backoff_attempt = 0
        if self.ever_ready:
            self.failures = 0
        delay = self.lc.exited(self.now, "daemon killed by SIGKILL")
        if stable:
            assert delay == POLICY.restart_backoff_initial_s, "a daemon that ran well restarts at once"
        self._down(delay)

    @precondition(lambda self: self.lc.running)
    @rule()
    def replaced(self) -> None:
        self.lc.replaced(self.now)
        self.ready_since = self.not_ready_since = self.silent_since = None
        self.ever_ready = False
        assert self.lc.start_due(self.now), "a new identity starts at once"

    @precondition(lambda self: self.lc.running)
    @rule(answered=st.booleans(), ready=st.booleans())
    def probe(self, answered: bool, ready: bool) -> None:
        ready = ready and answered
        was = self.lc.state
        if answered:
            self.silent_since = None
        elif self.silent_since is None:
            self.silent_since = self.now
        action = self.lc.probed(self.now, answered, ready, "waiting")
        self.last_action = action
        if ready:
            self.failures = 0
            self.ever_ready = True
            self.ready_since = self.ready_since if self.ready_since is not None else self.now
            self.not_ready_since = None
            assert self.lc.state == READY and action is ProbeAction.NOTHING
            return
        self.ready_since = None
        silent_long = (
            self.silent_since is not None and self.now - self.silent_since >= POLICY.unresponsive_kill_s
        )
        assert (action is ProbeAction.STOP) == silent_long
        if silent_long:
            return
        if not self.ever_ready:
            assert self.lc.state in (STARTING, FAILED)
            return
        if self.not_ready_since is None:
            self.not_ready_since = self.now
        long_enough = self.now - self.not_ready_since >= POLICY.not_ready_debounce_s
        if was == READY:
            assert self.lc.state == (NOT_READY if long_enough else READY), "debounce"
        else:
            assert self.lc.state == was

    # ---- model helpers ----------------------------------------------------------------

    def _begin(self) -> None:
        self.ever_ready = False
        self.ready_since = None
        self.not_ready_since = None
        self.silent_since = self.now

    def _down(self, delay: float) -> None:
        self.failures += 1
        expected = min(
            POLICY.restart_backoff_cap_s, POLICY.restart_backoff_initial_s * 2**self.backoff_attempt
        )
        assert delay == expected
        self.backoff_attempt += 1
        assert POLICY.restart_backoff_initial_s <= delay <= POLICY.restart_backoff_cap_s
        assert self.lc.next_start_at == self.now + delay
        assert self.lc.state == (FAILED if self.failures >= POLICY.failed_after else NOT_READY)
        assert self.lc.last_error
        self.ever_ready = False
        self.ready_since = self.not_ready_since = self.silent_since = None

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def restarts_count_every_start_after_the_first_attempt(self) -> None:
        assert self.lc.restarts == self.expected_restarts

    @invariant()
    def ready_only_while_running(self) -> None:
        if self.lc.state == READY:
            assert self.lc.running and self.lc.ready
        if not self.lc.running:
            assert not self.lc.ready

    @invariant()
    def failed_means_a_crash_loop(self) -> None:
        if self.lc.state == FAILED:
            assert self.failures >= POLICY.failed_after
        if self.lc.state == READY:
            assert self.lc.last_error == ""


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


class ReloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 50.0
        self.policy = ReloadPolicy(min_interval_s=5.2)
        self.owed = False
        self.sent: list[float] = []

    @rule(dt=steps)
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def address_changed(self) -> None:
        self.policy.changed()
        self.owed = True

    @rule()
    def daemon_restarted(self) -> None:
        self.policy.daemon_started()
        self.owed = False

    @rule(responsive=st.booleans())
    def tick(self, responsive: bool) -> None:
        allowed = not self.sent or self.now - self.sent[-1] >= 5.2
        sent = self.policy.should_send(self.now, responsive)
        assert sent == (self.owed and responsive and allowed)
        if sent:
            self.sent.append(self.now)
            self.owed = False

    @invariant()
    def spaced(self) -> None:
        assert all(b - a >= 5.2 for a, b in zip(self.sent, self.sent[1:], strict=False))

    @invariant()
    def due_when_owed(self) -> None:
        due = self.policy.due_at()
        assert (due is not None) == self.owed
        if due is not None and self.sent:
            assert due == self.sent[-1] + 5.2


TestReload = ReloadMachine.TestCase
TestReload.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_a_burst_of_changes_is_one_signal_and_the_next_waits_for_the_interval() -> None:
    policy = ReloadPolicy(min_interval_s=5.2)
    policy.changed()
    assert not policy.should_send(0.0, responsive=False), "a daemon that does not answer yet gets none"
    assert policy.should_send(0.1, responsive=True)
    for t in (0.2, 0.3, 1.0):
        policy.changed()
        assert not policy.should_send(t, responsive=True)
    assert policy.due_at() == 0.1 + 5.2
    assert policy.should_send(5.3, responsive=True)
    assert not policy.should_send(20.0, responsive=True), "nothing changed since"


def test_a_burst_of_joins_is_signalled_once_it_is_quiet() -> None:
    policy = ReloadPolicy(min_interval_s=5.2, settle_s=0.15, settle_max_s=1.0)
    for t in (0.0, 0.1, 0.2):  # joins 100 ms apart: the map is not quiet yet
        policy.changed(t)
        assert not policy.should_send(t + 0.01, responsive=True)
    assert policy.due_at() == pytest.approx(0.35)
    assert policy.should_send(0.35, responsive=True)
    # A burst that never goes quiet is still signalled settle_max_s after its first change.
    for t in (10.0, 10.1, 10.2, 10.3, 10.4, 10.5, 10.6, 10.7, 10.8, 10.9, 11.0):
        policy.changed(t)
    assert policy.due_at() == pytest.approx(11.0)
    assert policy.should_send(11.0, responsive=True)


def test_a_daemon_hung_at_start_is_stopped_after_the_silence_limit() -> None:
    lc = DaemonLifecycle(POLICY)
    lc.started(0.0)
    assert lc.probed(19.9, answered=False, ready=False) is ProbeAction.NOTHING
    assert lc.probed(20.0, answered=False, ready=False) is ProbeAction.STOP


def test_a_refused_daemon_is_failed_with_the_reason_and_never_due() -> None:
    lc = DaemonLifecycle(POLICY)
    lc.refused("driver 570.133.20 is older than 570.158.01")
    assert (lc.state, lc.last_error, lc.ready) == (
        FAILED,
        "driver 570.133.20 is older than 570.158.01",
        False,
    )
    assert not lc.start_due(0.0) and not lc.start_due(1e12)
    assert lc.probed(5.0, answered=False, ready=False) is ProbeAction.NOTHING  # nothing runs to stop


def test_policy_rejects_nonsense() -> None:
    import pytest

    with pytest.raises(ValueError, match="failed_after"):
        LifecyclePolicy(failed_after=0)
    with pytest.raises(ValueError, match="cap"):
        LifecyclePolicy(restart_backoff_initial_s=2.0, restart_backoff_cap_s=1.0)
