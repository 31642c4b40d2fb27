"""`cdsim check` names a node whose IMEX agent runs but whose record is not in the inventory.

The state directory is the one a running `cdsim up` leaves (run.json with the agent's pid,
cluster.json), around a real etcd and a real ``cd-imex-agent`` process; `cdsim check` runs as the
user runs it. The agent is frozen (alive, its lease still valid) while its record is garbled, so
it cannot write it again until it is continued.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.cdsim.cli import cdsim, ok
from tests.nodeagent.agent_procs import sim_cluster
from tests.polling import eventually
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import ProcessInfo, RunState
from tools.cdsim.services import IMEX_AGENT_KIND, imex_agent_name
from tools.etcd.server import EtcdServer

TTL_S = 2
IN_INVENTORY = "every node whose IMEX agent runs is in the inventory"


async def _registered(store: Store, node: str, timeout_s: float) -> None:
    async def registered() -> bool:
        item = await store.get(store.keys.node(node), pb.Node)
        return item is not None and item.lease != 0

    await eventually(registered, f"{node} to be registered", timeout_s)


async def test_cdsim_check_flags_a_running_node_missing_from_the_inventory(
    private_etcd: EtcdServer, tmp_path: Path
) -> None:
    layout = StateLayout.at(tmp_path / "sim")
    layout.root.mkdir(parents=True)
    etcd = EtcdConfig(endpoint=private_etcd.endpoint)
    async with Store(etcd) as store:
        with sim_cluster(etcd, trays=1) as sim:
            sim.cluster.save(layout.cluster_file)
            agent = sim.agent(sim.cluster.node_name(0, 0), imex_args=["--lease-ttl-s", str(TTL_S)]).imex
            assert agent is not None
            agent.start()
            process = agent.process
            assert process is not None
            info = ProcessInfo(
                name=imex_agent_name(agent.name),
                kind=IMEX_AGENT_KIND,
                pid=process.pid,
                running=True,
                healthy=True,
                node=agent.name,
            )
            RunState(phase="ready", etcd_endpoint=private_etcd.endpoint, processes={info.name: info}).save(
                layout
            )
            await _registered(store, agent.name, 30.0)
            assert IN_INVENTORY in ok(await asyncio.to_thread(cdsim, layout.root, "check"))

            process.send_signal(signal.SIGSTOP)
            try:
                await store.put_raw(store.keys.node(agent.name), b"\xff garbled by hand")
                failed = await asyncio.to_thread(cdsim, layout.root, "check", "--settle", "0.5")
            finally:
                process.send_signal(signal.SIGCONT)
            assert failed.returncode != 0, failed.stdout
            assert f"inv7: node {agent.name}'s IMEX agent is alive but its record" in failed.stderr, (
                failed.stderr
            )

            # Running again, the agent writes its record back and the check passes.
            await _registered(store, agent.name, float(TTL_S))
            assert IN_INVENTORY in ok(await asyncio.to_thread(cdsim, layout.root, "check"))
