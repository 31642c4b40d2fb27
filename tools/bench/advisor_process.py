"""The advisor under test: a `cd-placement-advisor` process started on a store, its CPU time
(whole process, and its event-loop thread), and a wait for it and etcd to be idle."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tools import launch
from tools.bench.proc_cpu import cpu_seconds


@dataclass
class AdvisorProcess:
    proc: subprocess.Popen[bytes]
    port: int
    extender_port: int

    # etcd's process, whose CPU per decision is reported beside the advisor's.
    etcd_pid: int = 0

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def loop_cpu_seconds(self) -> float:
        """CPU of the advisor's main thread, which runs its event loop: every decision needs it."""
        return cpu_seconds(self.proc.pid, self.proc.pid)

    def etcd_cpu_seconds(self) -> float:
        return cpu_seconds(self.etcd_pid) if self.etcd_pid else 0.0


def start_advisor(
    endpoint: str, prefix: str, log: Path, timeout_s: float = 120.0, profile: Path | None = None
) -> AdvisorProcess:
    """The advisor process; with `profile`, run under cProfile, which writes its stats there as it exits."""
    started = launch.start_service(
        "advisor",
        [
            "--etcd-endpoint", endpoint, "--etcd-prefix", prefix,
            "--grpc-host", "127.0.0.1", "--grpc-port", "0",
            "--extender-enabled", "true", "--extender-host", "127.0.0.1", "--extender-port", "0",
            # The load generator is one holder standing for many schedulers' pods; when the advisor
            # falls behind, its unreleased reservations would pass the per-holder cap (1,024 nodes)
            # and end the phase instead of measuring it.
            "--max-reserved-nodes-per-holder", "0",
            "--health-host", "127.0.0.1", "--health-port", "0",
            "--log-format", "json", "--log-level", "info",
        ],
        log,
        python_args=["-m", "cProfile", "-o", str(profile.resolve())] if profile else (),
    )  # fmt: skip

    def ready() -> bool:
        ports = launch.announced_ports(log)
        return "grpc" in ports and "extender" in ports and '"inventory synced"' in log.read_text()

    started.wait_healthy(ready, timeout_s, "ready", poll_s=0.2)
    ports = launch.announced_ports(log)
    return AdvisorProcess(started.proc, ports["grpc"], ports["extender"])


def wait_quiet(
    advisor: AdvisorProcess, busy_below: float = 0.05, window_s: float = 0.5, cap_s: float = 60.0
) -> float:
    """Wait until the advisor and etcd together use less than `busy_below` of a core over
    `window_s` (at most `cap_s`); the seconds waited. A phase that starts while the previous one's
    work is still being digested (a reserving phase's releases and their watch events) would
    measure both."""
    began = time.monotonic()
    while time.monotonic() - began < cap_s:
        before = advisor.cpu_seconds() + advisor.etcd_cpu_seconds()
        time.sleep(window_s)
        if advisor.cpu_seconds() + advisor.etcd_cpu_seconds() - before < busy_below * window_s:
            break
    return round(time.monotonic() - began, 2)
