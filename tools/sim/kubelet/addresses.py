"""Node IPs for real kubelets.

Kubelet refuses a loopback node IP and one that no interface of the host holds. Each simulated node
gets a /32 from 198.18.0.0/15 (RFC 2544's benchmarking range, which nothing on the Internet routes)
on the loopback interface, labelled so that leftovers of a killed run are recognised. A /32 adds a
`local` route for that one address and nothing else: packets to it are delivered on this machine
(`ip route get` says `local ... dev lo`), the loopback device cannot send a packet off the machine,
and no other route, sysctl or interface changes. remove() deletes exactly what add() added; should
the process be killed first, the next environment on the same address block takes the addresses
over, and the kernel drops them by itself after ADDRESS_LIFETIME_S anyway.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Iterable

NODE_IP_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
ADDRESS_LABEL = "lo:cdkubelet"
# Longer than any test session; the kernel removes an address whose valid lifetime ends.
ADDRESS_LIFETIME_S = 6 * 3600
_PER_BLOCK = 1024  # node ordinals per address block
_IP_TIMEOUT_S = 10.0


class NodeAddressError(RuntimeError):
    """An address could not be added or is already used by something else; the message says which."""


def node_ip(address_block: int, ordinal: int) -> str:
    """The node IP of node `ordinal` of the simulated cluster on `address_block`."""
    if not 0 <= ordinal < _PER_BLOCK - 1:
        raise NodeAddressError(f"node ordinal {ordinal} out of range [0, {_PER_BLOCK - 1}) for real kubelets")
    offset = address_block * _PER_BLOCK + ordinal + 1
    if offset >= NODE_IP_NETWORK.num_addresses:
        raise NodeAddressError(f"address block {address_block} has no node IPs in {NODE_IP_NETWORK}")
    return str(NODE_IP_NETWORK.network_address + offset)


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise NodeAddressError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def addresses_in_range() -> dict[str, str]:
    """Every address of NODE_IP_NETWORK on this host -> its label (or interface)."""
    found: dict[str, str] = {}
    # e.g. "1: lo    inet 198.18.0.1/32 scope global lo:cdkubelet\       valid_lft forever ..."
    for line in _ip("-4", "-o", "addr", "show", "to", str(NODE_IP_NETWORK)).splitlines():
        fields = line.split("\\")[0].split()
        if "inet" in fields and "scope" in fields:
            address = fields[fields.index("inet") + 1].split("/")[0]
            found[address] = fields[-1]  # the label, which is the interface's name when none is set
    return found


def is_local_only(address: str) -> bool:
    """Whether the kernel delivers packets for `address` on this machine, through loopback."""
    route = _ip("-4", "route", "get", address)
    return route.startswith("local ") and " dev lo " in route


class NodeAddresses:
    """The node IPs of one simulated cluster's kubelets, on the loopback interface while in use."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = list(addresses)
        self._added: list[str] = []

    def add(self) -> None:
        present = addresses_in_range()
        for address in self.addresses:
            label = present.get(address)
            if label is not None and label != ADDRESS_LABEL:
                raise NodeAddressError(f"{address} is already on this host ({label}); not taking it over")
            if label is None:
                lifetime = str(ADDRESS_LIFETIME_S)
                _ip(
                    "-4", "addr", "add", f"{address}/32", "dev", "lo", "label", ADDRESS_LABEL,
                    "valid_lft", lifetime, "preferred_lft", lifetime,
                )  # fmt: skip
            # else: the leftover of a killed run on this address block (blocks are exclusive)
            self._added.append(address)
            if not is_local_only(address):
                raise NodeAddressError(f"{address} is not routed to loopback after adding it")

    def remove(self) -> None:
        for address in self._added:
            try:
                _ip("-4", "addr", "del", f"{address}/32", "dev", "lo")
            except NodeAddressError:
                if address in addresses_in_range():
                    raise
        self._added.clear()


def remove_leftovers(addresses: Iterable[str]) -> list[str]:
    """Remove those of `addresses` still on this host with our label (a run killed before it could
    remove them); returns the ones removed. Addresses labelled otherwise are not touched."""
    present = addresses_in_range()
    removed = []
    for address in addresses:
        if present.get(address) == ADDRESS_LABEL:
            _ip("-4", "addr", "del", f"{address}/32", "dev", "lo")
            removed.append(address)
    return removed
