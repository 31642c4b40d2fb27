"""tests/polling.py: the success rule, backoff with a cap, the failure message, virtual time."""

from __future__ import annotations

import pytest

from tests.polling import MAX_DELAY_S, PollTimeout, VirtualClock, counts, eventually, wait_until


def test_success_rule_is_anything_but_none_and_false() -> None:
    assert [counts(v) for v in (None, False)] == [False, False]
    values: tuple[object, ...] = (True, 0, "", [], {}, 0.0, "x")
    assert all(counts(v) for v in values)


async def test_eventually_returns_the_value_a_sync_or_async_probe_waited_for() -> None:
    clock = VirtualClock()
    answers = iter([None, False, 0])

    assert await eventually(lambda: next(answers), "a count", 5, clock=clock, sleep=clock.sleep) == 0

    async def record() -> dict[str, int] | None:
        return {"generation": 2} if clock() > 1_001 else None

    found = await eventually(record, "the record", 5, clock=clock, sleep=clock.sleep)
    assert found == {"generation": 2}


async def test_eventually_backs_off_to_the_cap_and_fails_naming_what_timeout_and_explanation() -> None:
    clock = VirtualClock()
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await clock.sleep(seconds)

    with pytest.raises(PollTimeout) as raised:
        await eventually(
            lambda: None,
            "the domain to be Ready",
            30,
            explain=lambda: "status: NotReady",
            clock=clock,
            sleep=sleep,
        )
    assert str(raised.value) == "timed out after 30 s waiting for the domain to be Ready\nstatus: NotReady"
    assert isinstance(raised.value, AssertionError)
    assert sleeps[0] < sleeps[1] < sleeps[2], "the delay grows"
    assert max(sleeps) == MAX_DELAY_S, "and stops at its cap"
    assert sum(sleeps) == pytest.approx(30), "the last sleep ends at the deadline, not past it"


async def test_eventually_probes_once_more_at_the_deadline() -> None:
    clock = VirtualClock()
    ready_at = clock() + 2.0
    value = await eventually(lambda: clock() >= ready_at or None, "late", 2.0, clock=clock, sleep=clock.sleep)
    assert value is True


async def test_a_failing_explanation_does_not_hide_the_timeout() -> None:
    clock = VirtualClock()

    def broken() -> str:
        raise KeyError("gone")

    with pytest.raises(PollTimeout, match=r"waiting for x\n\(explain failed: KeyError\('gone'\)\)"):
        await eventually(lambda: False, "x", 1, explain=broken, clock=clock, sleep=clock.sleep)


def test_wait_until_uses_the_same_rule_and_message() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    polls = iter([False, None, ""])
    assert wait_until(lambda: next(polls), "a line", 5, clock=lambda: now[0], sleep=sleep) == ""
    with pytest.raises(PollTimeout, match=r"^timed out after 2.5 s waiting for etcd$"):
        wait_until(lambda: None, "etcd", 2.5, clock=lambda: now[0], sleep=sleep)


def test_the_virtual_clock_only_goes_forward() -> None:
    clock = VirtualClock(start_s=5)
    clock.advance(1.5)
    assert clock() == 6.5
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1)
