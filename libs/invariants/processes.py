"""Processes by their command lines (Linux /proc): what the invariants look for on a node."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The simulated IMEX daemon's entry script (tools/sim/imex/run_daemon.py).
IMEX_DAEMON_MARKER = "run_daemon.py"


@dataclass(frozen=True)
class ProcessEntry:
    pid: int
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        return " ".join(self.argv)


def list_processes() -> list[ProcessEntry]:
    me = os.getpid()
    out: list[ProcessEntry] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if not raw:  # kernel thread or zombie
            continue
        out.append(
            ProcessEntry(
                int(entry.name), tuple(a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0"))
            )
        )
    return out


def mentions(entry: ProcessEntry, text: str) -> bool:
    return any(text in arg for arg in entry.argv)


def imex_daemons_under(directory: Path) -> list[ProcessEntry]:
    """Simulated IMEX daemons whose config file lies under `directory` (a node's IMEX dir)."""
    prefix = str(directory).rstrip("/") + "/"
    return [
        p
        for p in list_processes()
        if mentions(p, IMEX_DAEMON_MARKER) and any(a.startswith(prefix) for a in p.argv)
    ]


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions `text` (e.g. a domain uid in a config path)."""
    return [p.pid for p in list_processes() if mentions(p, text)]
