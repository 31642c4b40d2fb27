"""Find the processes of a simulated cluster by their command lines (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal

from libs.invariants.processes import (
    IMEX_DAEMON_MARKER,
    ProcessEntry,
    imex_daemons_under,
    list_processes,
    mentions,
)
from tools.cdsim.layout import StateLayout

__all__ = ["IMEX_DAEMON_MARKER", "ProcessEntry", "imex_daemons_under", "list_processes", "mentions"]

ZYGOTE_MARKER = "tools.cdsim.zygote"
SUPERVISOR_MARKER = "tools.cdsim.supervisor"
# `up --kubernetes`: the control plane's programs (its etcd is found by --data-dir=), the nodes'
# kubelets and container runtimes.
KUBE_MARKERS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "/kubelet", "/crisim")


def cluster_processes(layout: StateLayout) -> list[ProcessEntry]:
    """Every process this cluster started: supervisor, fork server (and its services), etcd, IMEX daemons,
    and in Kubernetes mode the control plane."""
    root = str(layout.root)
    markers = (IMEX_DAEMON_MARKER, ZYGOTE_MARKER, SUPERVISOR_MARKER, "--data-dir=", *KUBE_MARKERS)
    return [p for p in list_processes() if mentions(p, root) and any(mentions(p, m) for m in markers)]


def kill_all(entries: list[ProcessEntry], sig: signal.Signals = signal.SIGKILL) -> list[int]:
    killed = []
    for p in entries:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, sig)
            killed.append(p.pid)
    return killed
