from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.sim.imex import protocol as proto
from tools.sim.imex.domain_status import DaemonStatus, build_nodes_report, format_nodes_table

field_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz.0123456789", min_size=1, max_size=20)


@given(
    verb=st.sampled_from([proto.HELLO, proto.CMD_STATUS, proto.REFUSE]),
    fields=st.dictionaries(field_name, st.text(max_size=60), max_size=8),
)
def test_any_field_value_survives_encoding(verb, fields):
    line = proto.encode(verb, fields)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert proto.decode(line) == (verb, fields)


def test_malformed_lines_are_rejected():
    with pytest.raises(ValueError):
        proto.decode(b"STATUS state\n")
    with pytest.raises(ValueError):
        proto.decode(b"STATUS \xff=1\n")


PLACEHOLDER = "127.255.255.254"


def status(state: str, connections: list[str], addresses: list[str], **extra: str) -> DaemonStatus:
    """Node 0's STATUS reply for a map of len(connections) nodes named n0, n1, ..."""
    fields = {
        "state": state,
        "pid": "42",
        "instance": "42.1",
        "node_id": "0",
        "version": "sim-2",
        "nodes": ",".join(f"n{i}" for i in range(len(connections))),
    }
    for i, (conn, addr) in enumerate(zip(connections, addresses, strict=True)):
        fields.update({f"conn.{i}": conn, f"addr.{i}": addr, f"why.{i}": "", f"inst.{i}": f"{i}.1"})
    fields.update(extra)
    return DaemonStatus.from_fields(fields)


A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def test_status_reply_is_keyed_by_node_id():
    st = status("READY", ["CONNECTED", "DISCONNECTED"], [A, B], **{"why.1": "peer is shutting down"})
    assert st.ready and (st.node_id, st.instance, st.nodes) == (0, "42.1", ["n0", "n1"])
    assert st.addresses == {0: A, 1: B}
    assert st.connections == {0: "CONNECTED", 1: "DISCONNECTED"}
    assert st.reasons == {1: "peer is shutting down"}
    assert st.peer_instances == {0: "0.1", 1: "1.1"}


def test_connected_to_every_real_slot_is_up_and_empty_slots_do_not_count():
    report = build_nodes_report(
        status("READY", ["CONNECTED", "CONNECTED", "NEVER_CONNECTED"], [A, B, PLACEHOLDER]),
        with_hostnames=True,
    )
    json.dumps(report)  # serialisable as -j prints it
    assert (report["status"], report["nodeId"], report["instance"]) == ("UP", 0, "42.1")
    mine = report["nodes"]["0"]
    assert mine["connections"]["1"] == {
        "host": B,
        "status": "CONNECTED",
        "changed": True,
        "hostName": "n1",
        "instance": "1.1",
    }
    assert report["nodes"]["1"]["status"] == "READY" and report["nodes"]["2"]["status"] == "UNAVAILABLE"


def test_a_lost_peer_degrades_and_a_daemon_not_ready_or_unreachable_is_down():
    lost = status("READY", ["CONNECTED", "DISCONNECTED"], [A, B])
    assert build_nodes_report(lost)["status"] == "DEGRADED"
    assert build_nodes_report(status("SHUTTING_DOWN", ["CONNECTED"], [A]))["status"] == "DOWN"
    assert build_nodes_report(None)["status"] == "DOWN"


def test_table_shows_a_node_map_mismatch_and_its_reason_reaches_json():
    mine = status("READY", ["CONNECTED", "NODE_MAP_MISMATCH"], [A, B], **{"why.1": "other domain"})
    report = build_nodes_report(mine)
    assert report["nodes"]["0"]["connections"]["1"]["reason"] == "other domain"
    table = format_nodes_table(report)
    assert "!M!" in table.splitlines()[-3]  # row of node 0
    assert "(other domain)" in table
    assert table.rstrip().endswith("Domain State: DEGRADED")


def test_the_ctl_shows_only_what_its_own_resolution_reaches():
    """`seen`: where the ctl runs, a name that does not resolve is a node it cannot reach, and a
    daemon whose own name does not resolve to its address cannot be placed in the map."""
    up = status("READY", ["CONNECTED", "CONNECTED", "CONNECTED"], [A, B, C], addr=A)
    inside = build_nodes_report(up, seen={0: A, 1: B, 2: C})
    assert set(inside["nodes"]["0"]["connections"]) == {"0", "1", "2"} and inside["status"] == "UP"
    partial = build_nodes_report(up, seen={0: A, 1: B})
    assert partial["nodes"]["2"] == {
        "status": "UNAVAILABLE",
        "host": "",
        "connections": {},
        "changed": True,
        "version": "",
    }
    assert partial["nodes"]["0"]["connections"]["2"]["host"] == "" and partial["status"] == "DEGRADED"
    for seen in ({}, {1: B, 2: C}, {0: B, 1: B, 2: C}):
        outside = build_nodes_report(up, seen=seen)
        assert all(node["connections"] == {} for node in outside["nodes"].values())
        assert {node["status"] for node in outside["nodes"].values()} == {"UNAVAILABLE"}
        assert "nodeId" not in outside and outside["status"] == "DEGRADED"
    assert (
        build_nodes_report(status("SHUTTING_DOWN", ["CONNECTED"], [A], addr=A), seen={})["status"] == "DOWN"
    )
