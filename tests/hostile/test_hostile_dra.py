"""Hostile input at the kubelet plugin's DRA socket, against a real node agent (and its IMEX agent).

After each input: the agent is healthy (/healthz, and the claim prepared first is answered again,
unchanged), the refusal names the field and limit (a per-claim error, or RESOURCE_EXHAUSTED for
an oversized message; never a failed call otherwise), the prepared claim's CDI spec is still
there, and the agent's RSS stays under RSS_BOUND_MB; its log has no traceback or over-long line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.wire.driver import dra_socket_path
from tests.hostile.advisor_process import rss_mb
from tests.nodeagent.agent_fakes import put_claim, put_domain
from tests.nodeagent.agent_procs import AgentProcess, Kubelet, sim_cluster

MB = 1024 * 1024
MAX_UID_BYTES = 128  # the default --max-claim-uid-bytes
DRA_MAX_MESSAGE_BYTES = 4 * MB  # the default --dra-max-message-bytes
RSS_BOUND_MB = 200


@dataclass
class Node:
    agent: AgentProcess
    prepared: ClaimRef
    answer: dra.NodePrepareResourceResponse


@pytest.fixture(scope="module")
def node(hostile_etcd_config: EtcdConfig) -> Iterator[Node]:
    """One node's agents, with a claim prepared before any hostile input."""
    with sim_cluster(hostile_etcd_config, trays=1) as cluster:
        agent = cluster.agent("rack0-tray0")
        agent.start_node()

        async def prepare() -> Node:
            await agent.wait_serving(30)
            store = Store(hostile_etcd_config)
            await store.connect()
            try:
                domain = await put_domain(store)
                ref = await put_claim(store, agent.name, domain.uid)
            finally:
                await store.close()
            answer = await Kubelet(agent).prepare(ref, 30)
            assert answer.error == "", answer.error
            return Node(agent, ref, answer)

        yield asyncio.run(prepare())


async def _still_fine(node: Node) -> None:
    status, _ = await node.agent.health()
    assert status == 200
    again = (await Kubelet(node.agent).prepare_once(node.prepared))[node.prepared.uid]
    assert again == node.answer, "the claim prepared before the hostile input changed"
    assert node.agent.cdi_spec(node.prepared.uid).exists(), "the prepared claim's CDI spec is gone"
    assert node.agent.process is not None
    rss = rss_mb(node.agent.process.pid)
    assert rss < RSS_BOUND_MB, f"node agent RSS {rss:.0f} MB"
    _assert_clean_log(node.agent.log_file)


def _assert_clean_log(log_file: Path) -> None:
    lines = log_file.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        assert "Traceback" not in line, "traceback in the agent's log:\n" + "\n".join(lines[i - 2 : i + 30])
        assert len(line) < 16_384, f"a {len(line)}-char log line: {line[:200]}"


@pytest.mark.parametrize(
    "claim, field, limit",
    [
        (ClaimRef("team-a", "c", "u" * MB), "uid", MAX_UID_BYTES),
        (ClaimRef("n" * MB, "c", "0f0e0d0c-0000-4000-8000-000000000001"), "namespace", 63),
        (ClaimRef("team-a", "c" * MB, "0f0e0d0c-0000-4000-8000-000000000002"), "name", 253),
        (ClaimRef("team-a", "c", "u" * (MAX_UID_BYTES + 1)), "uid", MAX_UID_BYTES),
    ],
)
async def test_an_over_long_claim_field_is_a_claim_error_naming_it(
    node: Node, claim: ClaimRef, field: str, limit: int
) -> None:
    kubelet = Kubelet(node.agent)
    prepared = await kubelet.prepare_once(claim, node.prepared)
    error = prepared[claim.uid].error
    assert f"claim {field}: " in error and f"the limit is {limit} bytes" in error, error[:300]
    assert len(error) < 1024, f"a {len(error)}-char error echoes the input"
    assert prepared[node.prepared.uid] == node.answer, "a bad claim cost the good one in the same request"
    unprepared = await kubelet.unprepare_once(claim)
    assert f"claim {field}: " in unprepared[claim.uid] and len(unprepared[claim.uid]) < 1024
    await _still_fine(node)


async def test_a_20_mb_message_is_refused_naming_the_limit(node: Node) -> None:
    claims = [ClaimRef("team-a", "c" * (4 * MB), f"uid-{i}") for i in range(5)]
    assert node.agent.process is not None
    before = rss_mb(node.agent.process.pid)
    for call in (Kubelet(node.agent).prepare_once, Kubelet(node.agent).unprepare_once):
        with pytest.raises(GRPCError) as caught:
            await call(*claims)
        assert caught.value.status is Status.RESOURCE_EXHAUSTED, caught.value
        assert str(DRA_MAX_MESSAGE_BYTES) in (caught.value.message or "")
        assert "--dra-max-message-bytes" in (caught.value.message or "")
    await _still_fine(node)
    print(
        f"node agent RSS before two 20 MB messages {before:.0f} MB, after {rss_mb(node.agent.process.pid):.0f} MB"
    )


async def test_undecodable_bytes_fail_the_call_not_the_agent(node: Node) -> None:
    from grpclib.const import Cardinality

    from services.advisor.transport import WireCodec

    channel = Channel(path=str(dra_socket_path(node.agent.kubelet_dir)), codec=WireCodec())
    try:
        for garbage in (b"\xff" * 32, b"\x0a\x05\x0a\x03ab", bytes(range(256))):
            async with channel.request(
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
                Cardinality.UNARY_UNARY,
                bytes,
                bytes,
                timeout=10,
            ) as call:
                await call.send_message(garbage, end=True)
                with pytest.raises(GRPCError) as caught:
                    await call.recv_message()
                assert caught.value.status is Status.INVALID_ARGUMENT, caught.value
                assert "not a valid NodePrepareResourcesRequest" in (caught.value.message or "")
    finally:
        channel.close()
    await _still_fine(node)


_field = st.text(max_size=30) | st.builds(
    lambda c, n: c * n, st.sampled_from("a-/é\x00"), st.integers(60, 600)
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    claims=st.lists(st.builds(ClaimRef, namespace=_field, name=_field, uid=_field), min_size=1, max_size=4),
    unprepare=st.booleans(),
)
async def test_any_claims_are_answered_each_with_a_short_error(
    node: Node, claims: list[ClaimRef], unprepare: bool
) -> None:
    kubelet = Kubelet(node.agent)
    if unprepare:
        errors = await kubelet.unprepare_once(*claims, timeout_s=30)
    else:
        errors = {uid: r.error for uid, r in (await kubelet.prepare_once(*claims, timeout_s=30)).items()}
    assert set(errors) == {c.uid for c in claims}, "every claim of the request is answered"
    for claim in claims:
        error = errors[claim.uid]
        assert len(error) < 1024, error[:300]
        if len(claim.uid.encode()) > MAX_UID_BYTES:
            assert "claim uid: " in error
        elif not unprepare:
            assert error, "an unknown claim cannot be prepared"
    status, _ = await node.agent.health()
    assert status == 200
