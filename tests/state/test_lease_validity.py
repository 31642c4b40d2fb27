"""A leader acts only while its lease is certainly valid (pure, fake clock), and its Kubernetes
writes are refused once it could have lapsed."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from libs.state.election import Leadership
from libs.state.lease_validity import LeaseValidity
from services.controller.kube.fence import NotLeading, fence_writes
from tools.net_ports import free_port


@given(
    ttl=st.integers(1, 30),
    steps=st.lists(
        st.tuples(st.floats(0, 20), st.booleans(), st.floats(0, 30)),  # (wait, refresh ok?, its latency)
        max_size=30,
    ),
)
def test_never_acts_past_a_lease_that_could_have_expired(
    ttl: int, steps: list[tuple[float, bool, float]]
) -> None:
    """Whatever the pauses and refresh latencies: at every moment the leader may act, the server's
    lease (started no earlier than the send of the last successful grant or refresh) is alive."""
    v = LeaseValidity(ttl, margin_s=0.1)
    now = 0.0
    v.granted(now)
    server_expiry = now + ttl  # the latest the server's lease can run, from the last send
    for wait, ok, latency in steps:
        now += wait
        if v.may_act(now):
            assert now < server_expiry
        timeout = v.refresh_timeout(now)
        if timeout <= 0:
            assert not v.may_act(now)
            continue
        sent = now
        if ok and latency <= timeout:
            now = sent + latency
            v.granted(sent)
            server_expiry = sent + ttl
        else:
            now = sent + min(latency, timeout)  # the refresh timed out (or failed) at its deadline
        if v.may_act(now):
            assert now < server_expiry
        assert timeout <= ttl / 2


def test_a_refresh_may_not_run_past_the_validity() -> None:
    v = LeaseValidity(6, margin_s=0.2)
    v.granted(100.0)
    assert v.refresh_timeout(100.0) == 3.0
    assert v.refresh_timeout(104.0) == pytest.approx(1.8)
    assert v.refresh_timeout(105.8) <= 0 and not v.may_act(105.8)


async def test_kubernetes_writes_are_refused_once_the_lease_could_have_lapsed() -> None:
    validity = LeaseValidity(5, margin_s=0.1)
    leadership = Leadership("cd-controller", "a", "/k", 1, 1, 0.0, validity)
    config = Configuration(host=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    async with ApiClient(config) as api:
        fence_writes(api, leadership)
        core = CoreV1Api(api)
        with pytest.raises(NotLeading, match="could have lapsed"):  # never granted: refused
            await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}, _request_timeout=1)
        validity.granted(time.monotonic())
        # Now leading: the request goes out (and fails to connect: nothing listens).
        with pytest.raises(Exception) as exc_info:
            await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}, _request_timeout=1)
        assert not isinstance(exc_info.value, NotLeading)
        # Reads never need the lease.
        with pytest.raises(Exception) as read_error:
            await asyncio.wait_for(core.read_node("n1", _request_timeout=1), 5)
        assert not isinstance(read_error.value, NotLeading)
