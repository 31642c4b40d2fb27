"""A real ``cd-imex-agent`` process on simulated hardware, as a test starts one (test helper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from libs.hardware.cluster import ClusterDescription
from libs.hardware.simulated import prepare_node_dirs
from tools.netports import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class AgentProcess:
    name: str
    health_url: str
    log_file: Path
    process: asyncio.subprocess.Process

    def log_events(self) -> list[dict[str, object]]:
        out = []
        for line in self.log_file.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


def _append(path: Path) -> BinaryIO:
    return open(path, "ab")  # the agent's output: handed to the child, closed right after


async def start_agent(
    cluster: ClusterDescription, base: Path, endpoint: str, prefix: str, tray: int, lease_ttl_s: int
) -> AgentProcess:
    """Start the agent of rack 0's `tray`; `base` holds cluster.json, the node dirs and its log."""
    name = cluster.node_name(0, tray)
    prepare_node_dirs(cluster, name, base / "hw")
    port = free_port()
    log_file = base / f"{name}.log"
    log = _append(log_file)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.imexagent.main",
            f"--node-name={name}",
            f"--etcd-endpoint={endpoint}",
            f"--etcd-prefix={prefix}",
            "--hardware=simulated",
            f"--sim-cluster={base / 'cluster.json'}",
            f"--sim-state-dir={base / 'hw'}",
            f"--imex-work-dir={base / 'imex' / name}",
            f"--lease-ttl-s={lease_ttl_s}",
            "--health-host=127.0.0.1",
            f"--health-port={port}",
            "--log-format=json",
            cwd=REPO,
            stdout=log,
            stderr=log,
        )
    finally:
        log.close()
    return AgentProcess(name, f"http://127.0.0.1:{port}/readyz", log_file, process)


async def stop_agent(agent: AgentProcess) -> None:
    """Kill the agent (continued first, should a test have stopped it) and reap it."""
    if agent.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            agent.process.send_signal(signal.SIGCONT)
            agent.process.kill()
    await agent.process.wait()
