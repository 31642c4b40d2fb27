"""CPU time of the processes a benchmark measures, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process so far (all its threads), or of one of its threads
    (`thread`: its id; a process's main thread has the process's id)."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
