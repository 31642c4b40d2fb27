"""Name resolution of the simulated IMEX daemon: literal IPs, else a hosts(5) file.

nvidia-imex resolves the nodes config's host names with the system resolver every time it dials
a peer (and when SIGUSR1 restarts its connections), so a rewritten /etc/hosts is seen without a
restart. The simulator stands in for /etc/hosts with the file named by ``# SIM_HOSTS_FILE``:
it is re-read whenever its identity, size or mtime changed since the last look (the IMEX agent
replaces it atomically, so a new inode is the usual signal), and ``force=True`` re-reads it
regardless (SIGUSR1). Without a hosts file only literal IPs resolve.

Imported by the daemon at start-up: only C-level modules here.
"""

from __future__ import annotations

import _socket
import os

from libs.imex.slots import parse_hosts


def is_ip(text: str) -> bool:
    """True for a literal IPv4 or IPv6 address."""
    for family in (_socket.AF_INET, _socket.AF_INET6):
        try:
            _socket.inet_pton(family, text)
        except (OSError, ValueError):
            continue
        return True
    return False


class HostsResolver:
    """Resolves nodes config entries; the hosts file is re-read only when it changed."""

    def __init__(self, hosts_file: str) -> None:
        self.hosts_file = hosts_file
        self.table: dict[str, str] = {}
        self.stamp: tuple[int, int, int, int] | None = None
        self.error = ""  # why the hosts file could not be read the last time ("" = fine)
        self.reads = 0  # how often the file was (re-)read, for the log

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the hosts file if it changed (or ``force``); True when it was re-read."""
        if not self.hosts_file:
            return False
        try:
            st = os.stat(self.hosts_file)
        except OSError as exc:
            self.table = {}
            self.stamp = None
            self.error = f"cannot read hosts file {self.hosts_file}: {exc.strerror}"
            return True
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self.stamp and not force:
            return False
        try:
            with open(self.hosts_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            self.table = {}
            self.stamp = None
            self.error = f"cannot read hosts file {self.hosts_file}: {exc}"
            return True
        self.table = parse_hosts(text)
        self.stamp = stamp
        self.error = ""
        self.reads += 1
        return True

    def resolve(self, entry: str, *, refresh: bool = True) -> tuple[str, str]:
        """(address, "") for a resolvable entry, else ("", why not)."""
        if is_ip(entry):
            return entry, ""
        if refresh:
            self.refresh()
        address = self.table.get(entry.lower(), "")
        if address:
            return address, ""
        if not self.hosts_file:
            return "", f"cannot resolve {entry}: no hosts file configured"
        if self.error:
            return "", f"cannot resolve {entry}: {self.error}"
        return "", f"cannot resolve {entry}: not in {self.hosts_file}"
