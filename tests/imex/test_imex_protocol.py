from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.imex.simulator import protocol as proto
from libs.imex.simulator.domain_status import DaemonStatus, build_nodes_report, format_nodes_table

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


def status(address: str, state: str, connections: dict[str, str], **extra: str) -> DaemonStatus:
    fields = {"state": state, "pid": "42", "addr": address, "version": "sim-1", "host": f"n-{address}"}
    fields.update({f"conn.{peer}": value for peer, value in connections.items()})
    fields.update(extra)
    return DaemonStatus.from_fields(fields)


A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def test_fully_connected_ready_domain_is_up():
    conns = {A: "CONNECTED", B: "CONNECTED", C: "CONNECTED"}
    report = build_nodes_report(
        [A, B, C], [status(x, "READY", conns) for x in (A, B, C)], with_hostnames=True
    )
    json.dumps(report)  # serialisable as -j prints it
    assert report["status"] == "UP"
    assert [report["nodes"][i]["host"] for i in ("0", "1", "2")] == [A, B, C]
    assert report["nodes"]["1"]["hostName"] == f"n-{B}"
    assert report["nodes"]["2"]["connections"]["0"] == {"host": A, "status": "CONNECTED", "changed": True}


def test_unreachable_node_is_unavailable_with_invalid_connections_and_degrades_the_domain():
    conns = {A: "CONNECTED", B: "CONNECTED", C: "NEVER_CONNECTED"}
    report = build_nodes_report(
        [A, B, C], [status(A, "WAITING_FOR_PEERS", conns), status(B, "READY", conns), None]
    )
    assert report["status"] == "DEGRADED"
    assert report["nodes"]["2"]["status"] == "UNAVAILABLE"
    assert {c["status"] for c in report["nodes"]["2"]["connections"].values()} == {"INVALID"}
    assert report["nodes"]["0"]["connections"]["2"]["status"] == "NEVER_CONNECTED"


def test_domain_without_a_ready_node_is_down():
    assert build_nodes_report([A, B], [None, None])["status"] == "DOWN"


def test_table_shows_a_node_map_mismatch_and_its_reason_reaches_json():
    mine = status(
        A, "WAITING_FOR_PEERS", {A: "CONNECTED", B: "NODE_MAP_MISMATCH"}, **{f"why.{B}": "other domain"}
    )
    report = build_nodes_report([A, B], [mine, None])
    assert report["nodes"]["0"]["connections"]["1"]["reason"] == "other domain"
    table = format_nodes_table(report)
    assert "!M!" in table.splitlines()[-4]  # row of node 0
    assert table.rstrip().endswith("Domain State: DOWN")
