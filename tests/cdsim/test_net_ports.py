"""Ports for simulated clusters come from outside the kernel's ephemeral range, so none of the
cluster's own outgoing connections can take one between choosing it and binding it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from tools.net_ports import free_port, free_ports


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_lie_below_the_ephemeral_range_and_never_repeat() -> None:
    low, _ = _ephemeral_range()
    ports = free_ports(200)
    assert len(set(ports)) == 200
    assert all(1024 < p < low for p in ports)


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidate that another socket holds is skipped for the next one that binds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        candidates = iter([busy, busy, 17001, 17002, 17003])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(candidates))
        port = free_port()
        assert port != busy
        assert port in (17001, 17002, 17003)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
