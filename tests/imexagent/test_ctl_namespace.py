"""Every ctl call runs where the daemon lives: in its mount namespace, where the slot names
resolve. The IMEX agent starts each daemon (simulated too) in a mount namespace of its own with
the domain's hosts file over /etc/hosts; the ctl resolves the node names itself, so a ctl run in
the agent's own namespace sees no peer, while the agent's probe, run inside, sees them all, by
the in-process simulator ctl or by an exec'd ctl entered with nsenter (the nvidia path)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from libs.imex.hosts_ns import in_namespace_argv
from libs.state.store import Store
from tests.imexagent.imex_rack import FAST, Rack, free_cluster, kill_daemons_under

UID = "cd-ctlns"
SIM_CTL = str(Path(sys.executable).with_name("imex-sim-ctl"))


def nodes_report(config: Path, pid: int | None = None) -> dict[str, object]:
    """``-N -j`` of the simulator's ctl as a process: here, or in the mount namespace of `pid`."""
    argv = [SIM_CTL, "-c", str(config), "-N", "-j"]
    done = subprocess.run(
        in_namespace_argv(pid, argv) if pid else argv, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def connected(report: dict[str, object]) -> set[int]:
    nodes = report["nodes"]
    assert isinstance(nodes, dict)
    return {
        int(i)
        for row in nodes.values()
        for i, link in row["connections"].items()
        if link["status"] == "CONNECTED"
    }


@pytest.fixture(params=["in-process", "exec"])
async def rack(request: pytest.FixtureRequest, store: Store, tmp_path: Path) -> AsyncIterator[Rack]:
    """A rack whose agents probe with the simulator's ctl in-process, or exec it through nsenter
    as they exec nvidia-imex-ctl with --imex-backend=nvidia."""
    settings = FAST if request.param == "in-process" else replace(FAST, ctl_command=(SIM_CTL,))
    r = Rack(store, tmp_path, free_cluster(3), settings)
    try:
        yield r
    finally:
        for node in r.nodes:
            await r.stop(node)
        kill_daemons_under(tmp_path)


async def test_only_a_ctl_in_the_daemons_namespace_sees_the_peers(rack: Rack) -> None:
    a, b, c = rack.node(0), rack.node(1), rack.node(2)
    for node in (a, b, c):
        rack.start(node)
        await rack.join(UID, node, [a, b, c].index(node))
    status = await rack.ready_status(UID, a, connected_nodes=[b.name, c.name])
    await rack.ready_status(UID, c, connected_nodes=[a.name, b.name])
    assert os.stat(f"/proc/{status.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino

    config = a.dir(UID) / "config.cfg"
    outside = await asyncio.to_thread(nodes_report, config)
    assert connected(outside) == set(), "the agent's namespace resolves no slot name"
    inside = await asyncio.to_thread(nodes_report, config, status.pid)
    assert connected(inside) == {0, 1, 2}
