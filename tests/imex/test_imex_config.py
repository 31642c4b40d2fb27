from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.imex import config as keys
from libs.imex.config import (
    parse_imex_config,
    parse_nodes_config,
    render_imex_config,
    render_nodes_config,
)

# Keys nvidia-imex reads; a rendered file must not carry any other non-comment key, or the real
# daemon might reject it.
REAL_KEYS = {
    "LOG_LEVEL",
    "LOG_FILE_NAME",
    "STATS_FILE_NAME",
    "LOG_APPEND_TO_LOG",
    "LOG_FILE_MAX_SIZE",
    "LOG_MAX_ROTATE_COUNT",
    "LOG_USE_SYSLOG",
    "DAEMONIZE",
    "BIND_INTERFACE_IP",
    "SERVER_PORT",
    "IMEX_NODE_CONFIG_FILE",
    "NETWORK_INTERFACE",
    "IMEX_WAIT_FOR_QUORUM",
    "IMEX_ENABLE_AUTH_ENCRYPTION",
    "IMEX_CMD_ENABLED",
    "IMEX_CMD_BIND_INTERFACE_IP",
    "IMEX_CMD_PORT",
    "IMEX_CMD_UNIX_DOMAIN_PATH",
    "IMEX_NODE_DISCONNECTED_GRACE_TIME",
}

octet = st.integers(min_value=0, max_value=255)
ipv4 = st.builds(lambda a, b, c: f"127.{a}.{b}.{c}", octet, octet, octet)
token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=40)
path = st.builds(lambda parts: "/" + "/".join(parts), st.lists(token, min_size=1, max_size=4))
port = st.integers(min_value=0, max_value=65535)


def real_lines(text: str) -> dict[str, str]:
    """What nvidia-imex sees: every non-comment KEY=VALUE line."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            seen[key] = value
    return seen


def _render(**overrides: object) -> str:
    kwargs: dict[str, object] = {
        "bind_interface_ip": "127.0.0.2",
        "nodes_config_file": "/run/imex/d1/nodes_config.cfg",
        "cmd_bind_interface_ip": "127.0.0.2",
        "log_file_name": "/run/imex/d1/nvidia-imex.log",
        "domain_id": "6f1c0d2e-uid",
    }
    kwargs.update(overrides)
    return render_imex_config(**kwargs)  # type: ignore[arg-type]


@given(
    bind_ip=ipv4,
    cmd_ip=ipv4,
    nodes_file=path,
    log_file=path,
    domain_id=token,
    node_name=token,
    server_port=port,
    cmd_port=port,
    quorum=st.sampled_from(["NONE", "RECOVERY"]),
    heartbeat=st.none() | st.floats(min_value=0.001, max_value=60),
    hosts_file=st.just("") | path,
    reconnect_initial=st.none() | st.floats(min_value=0.001, max_value=60),
)
def test_render_then_parse_gives_back_every_setting(
    bind_ip,
    cmd_ip,
    nodes_file,
    log_file,
    domain_id,
    node_name,
    server_port,
    cmd_port,
    quorum,
    heartbeat,
    hosts_file,
    reconnect_initial,
):
    text = render_imex_config(
        bind_interface_ip=bind_ip,
        nodes_config_file=nodes_file,
        cmd_bind_interface_ip=cmd_ip,
        log_file_name=log_file,
        domain_id=domain_id,
        node_name=node_name,
        server_port=server_port,
        cmd_port=cmd_port,
        wait_for_quorum=quorum,
        heartbeat_interval_s=heartbeat,
        hosts_file=hosts_file,
        reconnect_initial_s=reconnect_initial,
    )
    parsed = parse_imex_config(text)
    assert parsed[keys.BIND_INTERFACE_IP] == bind_ip
    assert parsed[keys.IMEX_CMD_BIND_INTERFACE_IP] == cmd_ip
    assert parsed[keys.IMEX_NODE_CONFIG_FILE] == nodes_file
    assert parsed[keys.LOG_FILE_NAME] == log_file
    assert parsed[keys.SERVER_PORT] == str(server_port)
    assert parsed[keys.IMEX_CMD_PORT] == str(cmd_port)
    assert parsed[keys.IMEX_WAIT_FOR_QUORUM] == quorum
    assert parsed[keys.SIM_DOMAIN_ID] == domain_id
    assert parsed[keys.SIM_NODE_NAME] == node_name
    if heartbeat is None:
        assert keys.SIM_HEARTBEAT_INTERVAL_S not in parsed
    else:
        assert float(parsed[keys.SIM_HEARTBEAT_INTERVAL_S]) == heartbeat
    assert parsed.get(keys.SIM_HOSTS_FILE, "") == hosts_file
    if reconnect_initial is not None:
        assert float(parsed[keys.SIM_RECONNECT_INITIAL_S]) == reconnect_initial
    # The real daemon sees only keys it knows; the simulator's identity stays in comments.
    assert set(real_lines(text)) <= REAL_KEYS
    assert all(line.startswith("# SIM_") for line in text.splitlines() if "SIM_" in line)


def test_rendered_file_has_the_settings_the_supervisor_relies_on():
    visible = real_lines(_render())
    assert visible["SERVER_PORT"] == "50000"
    assert visible["IMEX_CMD_PORT"] == "50005"
    assert visible["IMEX_CMD_ENABLED"] == "1"
    assert visible["DAEMONIZE"] == "0"
    assert visible["IMEX_WAIT_FOR_QUORUM"] == "RECOVERY"
    assert visible["LOG_FILE_NAME"] == "/run/imex/d1/nvidia-imex.log"


def test_overrides_replace_or_add_real_keys_but_not_managed_ones():
    text = _render(overrides={"LOG_LEVEL": "2", "IMEX_NODE_DISCONNECTED_GRACE_TIME": "30", "EXTRA_KEY": "x"})
    visible = real_lines(text)
    assert visible["LOG_LEVEL"] == "2"
    assert visible["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "30"
    assert visible["EXTRA_KEY"] == "x"
    assert text.count("LOG_LEVEL=") == 1
    for managed in ("IMEX_NODE_CONFIG_FILE", "IMEX_CMD_BIND_INTERFACE_IP", "DAEMONIZE", "SERVER_PORT"):
        with pytest.raises(ValueError, match=managed):
            _render(overrides={managed: "1"})


@pytest.mark.parametrize(
    "bad",
    [
        {"overrides": {"LOG_LEVEL": "3\nIMEX_NODE_CONFIG_FILE=/srv/evil"}},
        {"log_file_name": "/srv/a\nDAEMONIZE=1"},
        {"domain_id": "uid with space"},
        {"bind_interface_ip": ""},
        {"server_port": 70000},
        {"wait_for_quorum": "SOMETIMES"},
        {"overrides": {"SIM_DOMAIN_ID": "other"}},
        {"heartbeat_interval_s": -1.0},
        {"reconnect_initial_s": -0.5},
        {"hosts_file": "/run/imex/d1/hosts file"},
    ],
)
def test_values_that_would_corrupt_the_file_are_rejected(bad):
    with pytest.raises(ValueError):
        _render(**bad)


def test_parse_skips_commented_defaults_and_keeps_the_last_value():
    text = "\n".join(
        [
            "# LOG_FILE_NAME=/var/log/nvidia-imex.log",
            "#   Default Value: 50000",
            "SERVER_PORT=50000",
            "not a setting",
            "  SERVER_PORT = 50100  ",
            "#SIM_DOMAIN_ID=abc",
            "BIND_INTERFACE_IP=",
        ]
    )
    assert parse_imex_config(text) == {
        "SERVER_PORT": "50100",
        "SIM_DOMAIN_ID": "abc",
        "BIND_INTERFACE_IP": "",
    }


@given(st.lists(ipv4, unique=True, max_size=20))
def test_nodes_config_round_trip_keeps_index_order_and_is_stable(addresses):
    text = render_nodes_config(addresses)
    assert parse_nodes_config(text) == addresses
    assert render_nodes_config(list(addresses)) == text  # identical on every member
    assert text.count("\n") == len(addresses)


def test_nodes_config_takes_names_and_rejects_repeated_or_malformed_entries():
    names = ["s0.abc.uid.imex.invalid", "s1.abc.uid.imex.invalid", "127.0.0.9"]
    assert parse_nodes_config(render_nodes_config(names)) == names
    with pytest.raises(ValueError, match="twice"):
        render_nodes_config(["127.0.0.2", "127.0.0.3", "127.0.0.2"])
    with pytest.raises(ValueError, match="twice"):
        render_nodes_config(["s0.abc.invalid", "S0.ABC.invalid"])
    for bad in ["", "127.0.0.2 127.0.0.3", "127.0.0.2\n", "#127.0.0.2"]:
        with pytest.raises(ValueError):
            render_nodes_config([bad])


def test_rendered_header_does_not_promise_a_reread_of_the_nodes_config():
    header = _render().split("\n\n")[0]
    assert "read once, at daemon start" in header and "re-read" not in header
