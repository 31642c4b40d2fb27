"""The kubelet plugin owns its prepared claims' records: lost from the store, they come back.

One node's two programs as real processes on a real etcd. Without the record the controller
counts the node without claims of its domain (a LOST member coming back would be released and
lose its index), so an operator's delete or a garbled value must not stick. An unprepare's own
delete must stay done.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.nodeagent.agent_fakes import put_claim, put_domain
from tests.nodeagent.agent_procs import AgentProcess, Kubelet, SimCluster, sim_cluster
from tests.polling import eventually

pytestmark = pytest.mark.slow

# The IMEX agent's lease in these processes (tests/nodeagent/agent_procs.py).
LEASE_S = 3.0
NODE = "rack0-tray0"


@pytest.fixture
async def sim(etcd_config: EtcdConfig) -> AsyncIterator[SimCluster]:
    with sim_cluster(etcd_config, trays=1) as cluster:
        yield cluster


async def _record(store: Store, key: str) -> pb.PreparedClaim | None:
    item = await store.get(key, pb.PreparedClaim)
    return item.value if item is not None else None


def _logged(agent: AgentProcess, claim_uid: str, problem: str) -> bool:
    for line in agent.log_file.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if (
            event.get("event") == "prepared claim record lost from the store; written again"
            and event.get("claim_uid") == claim_uid
            and problem in str(event.get("problem"))
        ):
            return True
    return False


async def test_a_deleted_or_garbled_prepared_claim_record_is_written_again(
    sim: SimCluster, store: Store
) -> None:
    agent = sim.agent(NODE)
    agent.start_node()
    await agent.wait_serving()
    domain = await put_domain(store)
    ref = await put_claim(store, NODE, domain.uid)
    answer = await Kubelet(agent).prepare(ref, 60)
    assert answer.error == ""
    key = store.keys.preparation(NODE, ref.uid)
    prepared = await _record(store, key)
    assert prepared is not None and prepared.state == pb.PreparedState.PREPARE_COMPLETED

    for damage, problem in (("delete", "is missing (deleted)"), ("garbage", "undecodable value")):
        if damage == "delete":
            assert await store.delete(key)
        else:
            await store.put_raw(key, b"\xff\x01 garbled")

        async def back() -> bool:
            record = await _record(store, key)
            return record is not None and (
                record.state,
                record.domain_uid,
                record.namespace,
                list(record.cdi_device_ids),
            ) == (
                pb.PreparedState.PREPARE_COMPLETED,
                domain.uid,
                ref.namespace,
                list(prepared.cdi_device_ids),
            )

        await eventually(back, f"the prepared claim record back after {damage}", LEASE_S)
        await eventually(
            functools.partial(_logged, agent, ref.uid, problem), f"the plugin logs the {damage}", 5.0
        )

    # An unprepare deletes the record for good: the keeper does not bring it back.
    assert await Kubelet(agent).unprepare_once(ref) == {ref.uid: ""}
    assert await _record(store, key) is None
    await asyncio.sleep(LEASE_S)
    assert await _record(store, key) is None


async def test_a_record_dropped_with_its_claim_is_not_written_again_and_the_claim_is_unprepared(
    sim: SimCluster, store: Store
) -> None:
    """The controller drops a lost node's records whose claims are gone (Kubernetes deleted the
    pods of a node declared out of service). When that node comes back, its plugin still holds
    the claim in its checkpoint: writing the record again would make it hold a claim of a domain
    it is no member of (invariant 3). It unprepares the claim instead: no record, no CDI spec, no
    membership."""
    agent = sim.agent(NODE)
    agent.start_node()
    await agent.wait_serving()
    domain = await put_domain(store)
    ref = await put_claim(store, NODE, domain.uid)
    assert (await Kubelet(agent).prepare(ref, 60)).error == ""
    key = store.keys.preparation(NODE, ref.uid)
    assert agent.cdi_spec(ref.uid).exists()

    assert await store.delete(store.keys.claim(ref.uid))  # the claim is gone from its source
    assert await store.delete(key)  # and the controller dropped its record

    async def unprepared() -> bool:
        member = await store.get(store.keys.member(domain.uid, NODE), pb.Member)
        return not agent.cdi_spec(ref.uid).exists() and member is None

    await eventually(unprepared, "the plugin to unprepare the claim that is gone", 3 * LEASE_S)
    assert await _record(store, key) is None
    assert not _logged(agent, ref.uid, "")
