"""No split brain: a leading controller frozen past its lease writes nothing once it thaws.

Two `cd-controller` replicas in Kubernetes mode share one etcd lease election. The leader is
SIGSTOPped beyond its lease TTL; the standby takes over and handles a new ComputeDomain. Then the
old leader gets SIGCONT: its timers, watches and queued work all wake at once. The apiserver's
audit log (every mutating request, with the replica's user agent) must show no request of the old
leader after the standby took over, and the old leader's own counters no store write: its lease
validity ran out while it was frozen, so every write it attempts is refused before it is sent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.polling import wait_until
from tools import launch
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import ControlPlane
from tools.etcd.server import EtcdServer
from tools.net_ports import free_port

TTL_S = 2
WRITES = ("create", "update", "patch", "delete", "deletecollection")
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
"""

pytestmark = [pytest.mark.timeout(240)]


def compute_domain(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
        }
    )


class Replica:
    def __init__(self, name: str, cp: ControlPlane, etcd: EtcdServer, prefix: str, logs: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = logs / f"{name}.log"
        settings = [
            "--identity", name, "--mode", "kubernetes", "--kubeconfig", str(cp.kubeconfig),
            "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix, "--leader-lease-ttl-s", str(TTL_S),
            "--health-host", "127.0.0.1", "--health-port", str(self.port), "--log-format", "json",
        ]  # fmt: skip
        self.proc = launch.start_service("controller", settings, self.log, name=name).proc

    def metrics(self) -> dict[str, float]:
        try:
            return launch.metrics(self.port, timeout_s=2)
        except OSError:
            return {}

    def leading(self) -> bool:
        return self.metrics().get("cd_controller_leader") == 1.0

    def store_writes(self) -> float:
        m = self.metrics()
        return sum(
            v for k, v in m.items() if k.startswith("cd_controller_actions_total") and 'result="applied"' in k
        ) + m.get("cd_controller_status_writes_total", 0.0)

    def stop(self) -> None:
        with_signal(self.proc, signal.SIGCONT)
        launch.stop_process(self.proc)


def with_signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signum)


def has_status(cp: ControlPlane, name: str) -> bool:
    out = cp.kubectl(
        "get", "computedomain", name, "-n", "default", "-o", "jsonpath={.status.status}", check=False
    )
    return out.returncode == 0 and out.stdout.strip() != ""


def audit_writes(path: Path, agent: str, since: float) -> list[dict[str, object]]:
    """Mutating requests of user agent `agent` received after `since` (unix seconds)."""
    out: list[dict[str, object]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if not str(entry.get("userAgent", "")).startswith(agent) or entry.get("verb") not in WRITES:
            continue
        received = datetime.fromisoformat(str(entry["requestReceivedTimestamp"]).replace("Z", "+00:00"))
        if received.timestamp() > since:
            out.append(entry)
    return out


@pytest.fixture
def audited_plane(control_plane_binaries: Binaries, tmp_path: Path) -> Iterator[ControlPlane]:
    policy = tmp_path / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    cp = ControlPlane(
        control_plane_binaries,
        tmp_path / "cp",
        apiserver_args=(
            f"--audit-policy-file={policy}",
            f"--audit-log-path={tmp_path / 'audit.log'}",
            "--audit-log-mode=blocking",
        ),
    )
    cp.start()
    try:
        cp.kubectl("apply", "-f", str(launch.REPO / "manifests" / "base" / "crd-computedomains.yaml"))
        cp.kubectl(
            "wait", "--for=condition=Established", "crd/computedomains.resource.nvidia.com", "--timeout=60s"
        )
        yield cp
    finally:
        cp.stop()


def test_a_frozen_leader_writes_nothing_after_the_standby_took_over(
    audited_plane: ControlPlane, etcd: EtcdServer, tmp_path: Path
) -> None:
    cp, audit = audited_plane, tmp_path / "audit.log"
    prefix = f"/split-{os.getpid()}-{time.monotonic_ns()}/"
    a = Replica("split-a", cp, etcd, prefix, tmp_path)
    try:
        wait_until(a.leading, "replica a to lead", 60)
        b = Replica("split-b", cp, etcd, prefix, tmp_path)
        try:
            wait_until(lambda: b.metrics() != {}, "replica b to serve metrics", 60)
            cp.kubectl("apply", "-f", "-", input=compute_domain("first"))
            wait_until(
                lambda: audit_writes(audit, "cd-controller/split-a", 0) or None, "replica a to write", 30
            )
            wait_until(lambda: has_status(cp, "first"), "replica a to report the first domain", 30)
            time.sleep(1.0)  # its last writes of the first domain are answered
            store_writes = a.store_writes()

            os.kill(a.proc.pid, signal.SIGSTOP)
            wait_until(b.leading, "replica b to take over", 30)
            took_over = time.time()
            cp.kubectl("apply", "-f", "-", input=compute_domain("second"))
            wait_until(
                lambda: audit_writes(audit, "cd-controller/split-b", took_over) or None,
                "replica b to write",
                30,
            )
            os.kill(a.proc.pid, signal.SIGCONT)
            wait_until(lambda: a.metrics().get("cd_controller_leader") == 0.0, "replica a to step down", 30)
            time.sleep(3 * TTL_S)  # a's queued work, watches and sweeps have all had their turn
            assert a.proc.poll() is None, f"replica a died:\n{a.log.read_text()[-3000:]}"
            late = audit_writes(audit, "cd-controller/split-a", took_over)
            assert late == [], f"the old leader wrote after the takeover: {late[:3]}"
            assert a.store_writes() == store_writes, "the old leader wrote to the store after it thawed"
            assert b.leading() and has_status(cp, "second")
        finally:
            b.stop()
    finally:
        a.stop()
