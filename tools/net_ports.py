"""Free TCP ports for simulated clusters and tests, chosen where the kernel never auto-assigns.

A port found by binding to port 0 comes from the ephemeral range, the same range the kernel
draws from for every outgoing connection's source port. Between choosing such a port and the
service binding it, one of the cluster's own connections can take it ("address already in use"
at start). Ports below the ephemeral range are only ever taken by an explicit bind, so a port
checked free here stays free unless another program chooses the very same one.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOWEST = 10000
_handed_out: set[tuple[str, int]] = set()
_lock = threading.Lock()


def _ephemeral_floor() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, _LOWEST + 1000)


def _reserved() -> set[int]:
    """Ports the administrator reserved (ip_local_reserved_ports: "a,b-c,...")."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
    except OSError:
        return set()
    ports: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        ports.update(range(int(low), int(high or low) + 1))
    return ports


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on host that binds now, lies outside the ephemeral range, and was not handed out
    before by this process."""
    ceiling = _ephemeral_floor()
    reserved = _reserved()
    rng = random.SystemRandom()
    with _lock:
        for _ in range(2000):
            port = rng.randrange(_LOWEST, ceiling)
            if port in reserved or (host, port) in _handed_out:
                continue
            if _bindable(host, port):
                _handed_out.add((host, port))
                return port
    raise OSError(f"no free TCP port on {host} in {_LOWEST}-{ceiling - 1} after 2000 tries")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """count distinct free ports on host."""
    return [free_port(host) for _ in range(count)]
