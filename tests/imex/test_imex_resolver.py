from __future__ import annotations

import os
from pathlib import Path

from tools.sim.imex.resolver import HostsResolver, is_ip


def replace(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a new inode, as the IMEX agent writes it


def test_literal_ips_resolve_to_themselves_and_names_only_through_the_hosts_file(tmp_path: Path):
    assert is_ip("127.0.0.1") and is_ip("::1") and not is_ip("s0.x.invalid") and not is_ip("1.2.3")
    assert HostsResolver("").resolve("10.1.2.3") == ("10.1.2.3", "")
    address, why = HostsResolver("").resolve("s0.x.invalid")
    assert address == "" and "no hosts file" in why
    missing = HostsResolver(str(tmp_path / "hosts"))
    assert "cannot read hosts file" in missing.resolve("s0.x.invalid")[1]


def test_a_rewritten_hosts_file_is_seen_at_the_next_lookup(tmp_path: Path):
    hosts = tmp_path / "hosts"
    replace(hosts, "127.0.0.2 s0.x.invalid\n127.0.0.3 S1.X.invalid # comment\n127.0.0.9 s0.x.invalid\n")
    resolver = HostsResolver(str(hosts))
    assert resolver.resolve("s0.x.invalid") == ("127.0.0.2", "")  # the first line wins
    assert resolver.resolve("s1.x.INVALID") == ("127.0.0.3", "")  # names are case-insensitive
    assert "not in" in resolver.resolve("s2.x.invalid")[1]
    reads = resolver.reads
    assert not resolver.refresh()  # unchanged: not read again
    replace(hosts, "127.0.0.4 s0.x.invalid\n")
    assert resolver.resolve("s0.x.invalid") == ("127.0.0.4", "")
    assert resolver.reads == reads + 1
    assert resolver.refresh(force=True)  # SIGUSR1 reads it regardless
