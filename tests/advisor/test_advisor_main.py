"""`cd-placement-advisor` as a process: serves gRPC, the extender and health; stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
from grpclib.client import Channel

from libs.gen.computedomain.placement import v1 as pp
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.advisor.fleet import cluster_records, put_nodes
from tools import launch
from tools.sim.hardware.cluster import ClusterDescription


async def _read_ports(proc: asyncio.subprocess.Process, lines: list[dict], within_s: float) -> dict[str, int]:
    """Follow the JSON log until the gRPC, extender and health servers have announced their ports."""
    ports: dict[str, int] = {}
    deadline = time.monotonic() + within_s
    assert proc.stderr is not None
    while len(ports) < 3:
        raw = await asyncio.wait_for(proc.stderr.readline(), max(deadline - time.monotonic(), 0.1))
        if not raw:
            raise AssertionError(f"advisor exited early: {lines[-5:]}")
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        lines.append(line)
        if line.get("event") == "gRPC listening" and "port" in line:
            ports["grpc"] = line["port"]
        elif line.get("event") == "extender listening":
            ports["extender"] = line["port"]
        elif line.get("event") == "health server listening":
            ports["health"] = line["port"]
    return ports


async def test_process_serves_and_stops_on_sigterm(
    etcd_config: EtcdConfig, store: Store, tmp_path: Path
) -> None:
    await put_nodes(store, cluster_records(ClusterDescription(racks=2, seed="main-test")))
    socket_path = tmp_path / "advisor.sock"
    proc = await asyncio.create_subprocess_exec(
        *launch.service_argv(
            "advisor",
            [
                "--etcd-endpoint",
                etcd_config.endpoint,
                "--etcd-prefix",
                etcd_config.prefix,
                "--grpc-host",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--grpc-unix-socket",
                str(socket_path),
                "--extender-host",
                "127.0.0.1",
                "--extender-port",
                "0",
                "--extender-prefix",
                "/scheduler",
                "--health-host",
                "127.0.0.1",
                "--health-port",
                "0",
                "--log-format",
                "json",
            ],
        ),
        cwd=launch.REPO,
        env=launch.child_env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    lines: list[dict] = []
    try:
        ports = await _read_ports(proc, lines, 30.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for _ in range(100):
                async with http.get(f"http://127.0.0.1:{ports['health']}/readyz") as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("advisor never became ready")
            args = {
                "Pod": {"metadata": {"name": "p", "namespace": "default"}},
                "Nodes": None,
                "NodeNames": ["a"],
            }
            async with http.post(
                f"http://127.0.0.1:{ports['extender']}/scheduler/filter", json=args
            ) as response:
                assert response.status == 200
                assert (await response.json())["NodeNames"] == ["a"]
            async with http.get(f"http://127.0.0.1:{ports['health']}/metrics") as response:
                assert "cd_advisor_decisions_total" in await response.text()

        for channel in (Channel("127.0.0.1", ports["grpc"]), Channel(path=str(socket_path))):
            try:
                reply = await pp.PlacementAdvisorStub(channel, timeout=10).place(
                    pp.PlaceRequest(num_nodes=18)
                )
                assert reply.feasible and len(reply.placements[0].node_names) == 18
            finally:
                channel.close()
        assert os.stat(socket_path).st_mode & 0o002 == 0, "the gRPC socket must not be world-writable"

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15.0) == 0
        assert not socket_path.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bad_setting_exits_2_naming_the_setting() -> None:
    proc = await asyncio.create_subprocess_exec(
        *launch.service_argv(
            "advisor",
            [
                "--grpc-port",
                "-5",
            ],
        ),
        cwd=launch.REPO,
        env=launch.child_env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30.0)
    assert proc.returncode == 2
    assert "--grpc-port" in err.decode()
