"""The network namespace in which every containerd of one environment runs, and with it the pods'
bridge (tools.containerd.config): the host's interfaces, routes and iptables are never touched.

A process of ours holds the namespace (`unshare --net`, then it sleeps); its only interfaces are its
own loopback and what the CNI bridge plugin adds. No route leads out of it, so pods reach each other
(one bridge, a range of the pod network per node) and nothing else. The namespace ends with its
last process: the holder, once every containerd and shim has stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from tools.controlplane.cluster import die_with_parent

log = structlog.get_logger(__name__)

_HOLD = "ip link set lo up && exec sleep infinity"
_START_TIMEOUT_S = 10.0
_STOP_GRACE_S = 10.0


class NamespaceError(RuntimeError):
    """A namespace holder did not start; the message says why."""


def wait_for_exec(popen: subprocess.Popen[bytes], program: str, what: str) -> None:
    """Wait until `popen` has run its setup and exec'd `program` (then its namespace is ready)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise NamespaceError(f"{what} exited with code {popen.returncode} while setting up")
        with contextlib.suppress(OSError):
            if os.path.basename(os.readlink(f"/proc/{popen.pid}/exe")) == program:
                return
        time.sleep(0.05)
    raise NamespaceError(f"{what} did not finish its setup within {_START_TIMEOUT_S:.0f} s")


def end_process(popen: subprocess.Popen[bytes], grace_s: float = _STOP_GRACE_S) -> bool:
    """SIGTERM, then SIGKILL after `grace_s`; returns whether it had to be killed."""
    if popen.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(grace_s)
        return False
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(grace_s)
        return True


@dataclass
class PodNetworkNamespace:
    """The environment's pod network namespace, held by a process of ours while it runs."""

    log_path: Path
    _holder: subprocess.Popen[bytes] | None = None

    @property
    def path(self) -> str:
        """/proc/<holder>/ns/net, for `nsenter --net=`."""
        if self._holder is None:
            raise NamespaceError("the pod network namespace is not running")
        return f"/proc/{self._holder.pid}/ns/net"

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            self._holder = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-ec", _HOLD],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # only prctl: safe between fork and exec
            )
        wait_for_exec(self._holder, "sleep", "the pod network namespace holder")
        log.info("pod_network_started", pid=self._holder.pid)

    def run(self, argv: list[str], timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
        """`argv` run in the namespace (e.g. `ip -o link` to see the bridge)."""
        return subprocess.run(
            ["nsenter", f"--net={self.path}", "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def stop(self) -> None:
        if self._holder is not None:
            end_process(self._holder)
            self._holder = None
