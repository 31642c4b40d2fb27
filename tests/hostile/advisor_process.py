"""A real `cd-placement-advisor` process on the test etcd, with small limits, for the bad-input suite.

A process of its own (not in pytest's), so that its memory can be read from /proc and its log
checked for tracebacks.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.advisor.fleet import cluster_records, put_nodes
from tests.polling import wait_until
from tools import launch
from tools.sim.hardware.cluster import ClusterDescription

IDLE_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 24
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_FIELD_BYTES = 253
GRPC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the default
# The advisor's resident memory must stay under this after the large-body inputs (it starts near 70 MB).
RSS_BOUND_MB = 200


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class AdvisorProcess:
    proc: subprocess.Popen[bytes]
    log_file: Path
    grpc_port: int
    extender_port: int
    health_port: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_lines(self) -> list[str]:
        return self.log_file.read_text(errors="replace").splitlines()

    def assert_clean_log(self) -> None:
        """No traceback and no line longer than the logging setup allows (values clipped)."""
        for line in self.log_lines():
            assert "Traceback" not in line, f"traceback in the advisor's log: {line[:300]}"
            assert len(line) < 16_384, f"a {len(line)}-char log line: {line[:200]}"

    async def healthy(self) -> None:
        assert self.proc.poll() is None, "the advisor exited"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(f"http://127.0.0.1:{self.health_port}/healthz") as response,
        ):
            assert response.status == 200, await response.text()


def _ports(log_file: Path, proc: subprocess.Popen[bytes], within_s: float) -> dict[str, int]:
    def announced() -> dict[str, int] | None:
        assert proc.poll() is None, f"advisor exited: {log_file.read_text()[-2000:]}"
        ports = launch.announced_ports(log_file)
        return ports if len(ports) == 3 else None

    return wait_until(
        announced,
        "the advisor to announce its gRPC, extender and health ports",
        within_s,
        explain=lambda: log_file.read_text()[-2000:],
        first_delay_s=0.1,
        max_delay_s=0.5,
    )


def start_advisor(etcd_config: EtcdConfig, work: Path) -> Iterator[AdvisorProcess]:
    """Write an 18-node rack into the store, start the advisor on it, stop it at the end."""

    async def seed() -> None:
        store = Store(etcd_config)
        await store.connect()
        try:
            await put_nodes(store, cluster_records(ClusterDescription(racks=1, seed="hostile")))
        finally:
            await store.close()

    asyncio.run(seed())
    log_file = work / "advisor.log"
    settings = [
        f"--etcd-endpoint={etcd_config.endpoint}",
        f"--etcd-prefix={etcd_config.prefix}",
        "--grpc-host=127.0.0.1",
        "--grpc-port=0",
        "--extender-host=127.0.0.1",
        "--extender-port=0",
        "--health-host=127.0.0.1",
        "--health-port=0",
        "--log-format=json",
        f"--idle-timeout-s={IDLE_TIMEOUT_S}",
        f"--max-connections={MAX_CONNECTIONS}",
        f"--extender-max-body-bytes={MAX_BODY_BYTES}",
        "--identity=hostile-advisor",
    ]
    proc = launch.start_service("advisor", settings, log_file).proc
    try:
        ports = _ports(log_file, proc, 30.0)
        advisor = AdvisorProcess(proc, log_file, ports["grpc"], ports["extender"], ports["health"])
        asyncio.run(_wait_ready(advisor))
        yield advisor
    finally:
        launch.stop_process(proc)


async def _wait_ready(advisor: AdvisorProcess) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for _ in range(200):
            async with http.get(f"http://127.0.0.1:{advisor.health_port}/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError("advisor never became ready")


async def raw_connection_closed_within(port: int, payload: bytes, drip: bytes, within_s: float) -> float:
    """Connect, send `payload`, then one byte of `drip` every 0.2 s; seconds until the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        writer.write(payload)
        await writer.drain()
        index = 0
        while time.monotonic() - started < within_s:
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.2)
            except TimeoutError:
                data = None
            except ConnectionError:
                data = b""
            if data == b"":
                return time.monotonic() - started
            if drip:
                try:
                    writer.write(drip[index % len(drip) : index % len(drip) + 1])
                    await writer.drain()
                except ConnectionError:
                    return time.monotonic() - started
                index += 1
        raise AssertionError(f"connection still open after {within_s} s")
    finally:
        writer.close()
