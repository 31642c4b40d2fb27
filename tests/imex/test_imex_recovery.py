"""The simulated daemon's persistence file and recovery wait, as NVIDIA's IMEX guide describes
them ("Connections, Quorum, and Clean up"): after an unclean stop a new instance waits until the
nodes that imported its memory reconnected; NONE, a clean stop or a changed nodes config skip it.
Also the driver version gate on host names in the nodes config."""

from __future__ import annotations

import asyncio
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.imex.config import DEFAULT_CMD_PORT, QUORUM_NONE
from tests.imex.simdomain import SimCluster, SimNode, start
from tests.imex.test_imex_daemon import ctl
from tools.sim.imex import client
from tools.sim.imex import recovery as persist

PORT = DEFAULT_CMD_PORT
KEY = "digest-1"

# ---- the file and the decision (pure) -----------------------------------------------------


@given(
    key=st.text(alphabet="0123456789abcdef", min_size=1, max_size=16),
    importers=st.dictionaries(
        st.integers(0, 17), st.from_regex(r"127\.0\.[0-9]{1,3}\.[0-9]{1,3}", fullmatch=True)
    ),
)
def test_the_file_says_what_it_was_given(key: str, importers: dict[int, str]) -> None:
    assert persist.parse(persist.render(key, importers)) == (key, importers)


@pytest.mark.parametrize(
    "text",
    ["", "1: 127.0.0.1\n", "key=\n", "key=k\nnode 1 127.0.0.1\n", "key=k\nx: 127.0.0.1\n", "key=k\n3:\n"],
)
def test_a_malformed_file_is_discarded_with_the_reason(text: str) -> None:
    with pytest.raises(ValueError):
        persist.parse(text)
    recovery = persist.Recovery(KEY, True, text, own_id=0, node_count=18)
    assert not recovery.waiting and "unreadable, discarded" in recovery.decision


def test_only_outstanding_importers_under_the_same_key_with_recovery_make_it_wait() -> None:
    listed = persist.render(KEY, {1: "10.0.0.2", 2: "10.0.0.3"})
    assert persist.Recovery(KEY, True, None, 0, 18).decision == "no persistence file: nothing to recover"
    assert "nothing to recover" in persist.Recovery(KEY, True, persist.render(KEY, {}), 0, 18).decision
    other = persist.Recovery("digest-2", True, listed, 0, 18)
    assert not other.waiting and "nodes config changed" in other.decision
    off = persist.Recovery(KEY, False, listed, 0, 18)
    assert not off.waiting and "IMEX_WAIT_FOR_QUORUM=NONE" in off.decision
    on = persist.Recovery(KEY, True, listed, 0, 18)
    assert on.waiting and on.outstanding == {1: "10.0.0.2", 2: "10.0.0.3"}
    assert "node 1 (10.0.0.2), node 2 (10.0.0.3)" in on.decision
    # Its own ID and IDs outside the map are no importers.
    assert not persist.Recovery(KEY, True, persist.render(KEY, {0: "a", 18: "b"}), 0, 18).waiting


def test_the_wait_ends_when_every_importer_is_back_at_its_address() -> None:
    r = persist.Recovery(KEY, True, persist.render(KEY, {1: "10.0.0.2", 2: "10.0.0.3"}), 0, 18)
    assert not r.reconnected(3, "10.0.0.4")  # never an importer
    assert not r.reconnected(1, "10.0.0.9") and r.mismatched == {1}  # another node in slot 1
    assert not r.reconnected(1, "10.0.0.2") and r.waiting
    assert r.reconnected(2, "10.0.0.3") and not r.waiting
    assert r.persisted() == persist.render(KEY, {})


def test_the_file_tracks_importers_and_a_clean_stop_keeps_only_the_unreconnected() -> None:
    r = persist.Recovery(KEY, True, persist.render(KEY, {5: "10.0.0.6"}), 0, 18)
    assert r.imported(1, "10.0.0.2", "job-a") and not r.imported(1, "10.0.0.2", "job-a")
    assert r.imported(1, "10.0.0.2", "job-b") and r.imported(2, "10.0.0.3", "job-a")
    assert persist.parse(r.persisted())[1] == {1: "10.0.0.2", 2: "10.0.0.3", 5: "10.0.0.6"}
    assert r.unimported(1, "job-a") and not r.unimported(1, "job-a")
    assert 1 in persist.parse(r.persisted())[1]  # job-b still imports from us
    assert r.unimported(1, "job-b") and r.importer_gone(2) and not r.importer_gone(2)
    assert persist.parse(r.persisted())[1] == {5: "10.0.0.6"}
    r.imported(3, "10.0.0.4", "job-c")
    assert persist.parse(r.persisted(shutting_down=True))[1] == {5: "10.0.0.6"}


_IMPORTER_EVENTS = st.lists(
    st.tuples(st.sampled_from(["imported", "unimported", "gone"]), st.integers(1, 4), st.sampled_from("ab")),
    max_size=40,
)


@given(events=_IMPORTER_EVENTS, outstanding=st.dictionaries(st.integers(1, 4), st.just("10.9.9.9")))
def test_the_file_always_lists_the_outstanding_and_every_node_with_a_job_importing(
    events: list[tuple[str, int, str]], outstanding: dict[int, str]
) -> None:
    r = persist.Recovery(KEY, True, persist.render(KEY, outstanding) if outstanding else None, 0, 18)
    jobs: dict[int, set[str]] = {}  # the model: which jobs of which node import from us
    for kind, node_id, job in events:
        before = {n for n, js in jobs.items() if js}
        if kind == "imported":
            jobs.setdefault(node_id, set()).add(job)
            changed = r.imported(node_id, f"10.0.0.{node_id}", job)
        elif kind == "unimported":
            jobs.get(node_id, set()).discard(job)
            changed = r.unimported(node_id, job)
        else:
            jobs.pop(node_id, None)
            changed = r.importer_gone(node_id)
        after = {n for n, js in jobs.items() if js}
        assert changed or before == after  # every change of the listed nodes is written
        listed = persist.parse(r.persisted())[1]
        assert set(listed) == after | set(outstanding)
        assert all(listed[n] == outstanding.get(n, f"10.0.0.{n}") for n in listed)
        assert set(persist.parse(r.persisted(shutting_down=True))[1]) == set(outstanding)


# ---- real daemon processes ------------------------------------------------------------------


async def state_of(node: SimNode) -> str:
    """What `nvidia-imex-ctl -q` prints, from the ctl process."""
    result = await ctl(node, "-q")
    return result.stdout.strip()


async def import_from(importer: SimNode, job: str, node_id: int) -> None:
    await client.import_memory(importer.address, PORT, job, node_id, 1.0)


async def exporter_with_importers(cluster: SimCluster, **options: object) -> list[SimNode]:
    """Three daemons; nodes 1 and 2 import memory of node 0, which lists them in its file."""
    nodes = cluster.domain(3, **options)  # type: ignore[arg-type]
    await start(nodes)
    await import_from(nodes[1], "job-a", 0)
    await import_from(nodes[2], "job-a", 0)
    await nodes[0].wait_until(
        lambda _: set(persist.parse(nodes[0].persist_path.read_text())[1]) == {1, 2},
        "both importers recorded",
    )
    return nodes


async def test_after_a_kill_the_new_instance_waits_for_every_importer_then_is_ready(cluster: SimCluster):
    n0, n1, n2 = await exporter_with_importers(cluster)
    key, importers = persist.parse(n0.persist_path.read_text())
    assert importers == {1: n1.address, 2: n2.address} and key == (await n0.status()).map_digest
    n0.kill()  # SIGKILL: no BYE, the file stays as it was
    n1.kill()  # an importer that is gone too

    n0.spawn()
    await n0.wait_until(lambda st: st.connections.get(2) == "CONNECTED", "node 2 reconnected")
    await n0.wait_log("Recovery: node 2")
    for _ in range(3):  # node 1 never comes back: the wait goes on, with no time limit
        assert await state_of(n0) == "WAITING_FOR_RECOVERY"
        await asyncio.sleep(0.3)
    assert "not shut down cleanly" in n0.log_text() and f"node 1 ({n1.address})" in n0.log_text()
    with pytest.raises(client.CommandRejected, match="WAITING_FOR_RECOVERY"):
        await import_from(n0, "job-b", 2)
    assert persist.parse(n0.persist_path.read_text())[1] == {1: n1.address}  # node 2 is done

    n1.spawn()  # node 1's new instance has no references left: it has recovered
    await n0.wait_until(lambda st: st.state == "READY", "READY once node 1 is back", timeout_s=10)
    assert await state_of(n0) == "READY"
    assert "Recovery complete" in n0.log_text()
    assert persist.parse(n0.persist_path.read_text())[1] == {}
    await import_from(n0, "job-b", 2)  # ready for work


async def test_with_none_the_new_instance_is_ready_at_once(cluster: SimCluster):
    n0, n1, _ = await exporter_with_importers(cluster, wait_for_quorum=QUORUM_NONE)
    n0.kill()
    n1.kill()
    n0.spawn()
    await n0.wait_until(lambda st: st.state == "READY", "READY without waiting")
    assert "IMEX_WAIT_FOR_QUORUM=NONE" in n0.log_text()


async def test_a_crash_by_fault_injection_is_an_unclean_stop(cluster: SimCluster):
    n0, n1, _ = await exporter_with_importers(cluster)
    n1.kill()
    await client.inject_fault(n0.address, PORT, "crash")
    assert n0.wait_exit() == 1
    n0.spawn()
    await n0.wait_until(lambda st: st.state == "WAITING_FOR_RECOVERY", "waiting for node 1")


async def test_a_clean_stop_leaves_nothing_to_recover(cluster: SimCluster):
    n0, n1, _ = await exporter_with_importers(cluster)
    n1.kill()
    n0.signal(signal.SIGTERM)
    assert n0.wait_exit() == 0
    assert persist.parse(n0.persist_path.read_text())[1] == {}  # the importers were told (BYE)
    n0.spawn()
    await n0.wait_until(lambda st: st.state == "READY", "READY at once")


async def test_an_importer_that_drops_its_imports_is_no_longer_waited_for(cluster: SimCluster):
    n0, n1, _ = await exporter_with_importers(cluster)
    await client.unimport(n1.address, PORT, "job-a", 1.0)
    await n0.wait_until(
        lambda _: set(persist.parse(n0.persist_path.read_text())[1]) == {2}, "node 1 dropped from the file"
    )
    n0.kill()
    n1.kill()
    n0.spawn()
    await n0.wait_until(lambda st: st.state == "READY", "READY once node 2 reconnected")


async def test_a_changed_nodes_config_discards_the_file(cluster: SimCluster):
    n0, n1, n2 = await exporter_with_importers(cluster)
    n0.kill()
    n1.kill()
    # Another map (literal addresses instead of slot names): another key.
    n0.write_config([n0.address, n1.address, n2.address], names=[n0.address, n1.address, n2.address])
    n0.spawn()
    await n0.wait_until(lambda st: st.state == "READY", "READY at once")
    assert "nodes config changed since the persistence file was written: discarded" in n0.log_text()


# ---- driver version -------------------------------------------------------------------------


async def test_an_older_driver_refuses_host_names_with_an_error(cluster: SimCluster):
    (old,) = cluster.domain(1, driver_version="570.133.20")  # type: ignore[arg-type]
    old.spawn()
    assert old.wait_exit() == 1
    log = old.log_text()
    assert "[ERROR]" in log and "Invalid IP address" in log and "570.158.01" in log and "570.133.20" in log


async def test_an_older_driver_runs_a_nodes_config_of_literal_addresses(cluster: SimCluster):
    (old,) = cluster.domain(1, driver_version="570.133.20")  # type: ignore[arg-type]
    old.write_config([old.address], names=[old.address])
    old.spawn()
    await old.wait_until(lambda st: st.state == "READY", "READY")


async def test_the_first_release_with_host_names_accepts_them(cluster: SimCluster):
    (node,) = cluster.domain(1, driver_version="570.158.01")  # type: ignore[arg-type]
    node.spawn()
    await node.wait_until(lambda st: st.state == "READY", "READY")
