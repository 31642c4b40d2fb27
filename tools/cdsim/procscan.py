"""Find the processes of a simulated cluster by their command lines (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tools.cdsim.layout import StateLayout

IMEX_DAEMON_MARKER = "run_daemon.py"
ZYGOTE_MARKER = "tools.cdsim.zygote"
SUPERVISOR_MARKER = "tools.cdsim.supervisor"


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


def _mentions(entry: ProcessEntry, text: str) -> bool:
    return any(text in arg for arg in entry.argv)


def imex_daemons_under(directory: Path) -> list[ProcessEntry]:
    """Simulated IMEX daemons whose config file lies under `directory` (a node's IMEX dir)."""
    prefix = str(directory).rstrip("/") + "/"
    return [
        p
        for p in list_processes()
        if _mentions(p, IMEX_DAEMON_MARKER) and any(a.startswith(prefix) for a in p.argv)
    ]


def cluster_processes(layout: StateLayout) -> list[ProcessEntry]:
    """Every process this cluster started: supervisor, fork server (and its services), etcd, IMEX daemons."""
    root = str(layout.root)
    markers = (IMEX_DAEMON_MARKER, ZYGOTE_MARKER, SUPERVISOR_MARKER, "--data-dir=")
    return [p for p in list_processes() if _mentions(p, root) and any(_mentions(p, m) for m in markers)]


def kill_all(entries: list[ProcessEntry], sig: signal.Signals = signal.SIGKILL) -> list[int]:
    killed = []
    for p in entries:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, sig)
            killed.append(p.pid)
    return killed
