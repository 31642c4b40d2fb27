"""A consistent ComputeDomain planted in a real etcd and on disk, for the checker's tests.

Four nodes: n0 and n1 active fabric members at indices 0 and 1, each with its IMEX daemon's files
as the IMEX agent writes them (the 18-slot nodes config, the hosts file, a JSON pidfile) and a
real process standing in for the daemon; n2 a LOST member that keeps index 2 and its address
(its node is gone: no files); n3 a non-fabric member (no clique, index -1). Every member has its
node binding, index claim and a completed prepared claim of the domain's namespace. Tests break
one thing and show the checker names it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.invariants.checker import NodeLocalPaths, check_store_invariants
from libs.state.store import Store
from services.imexagent.process import write_pidfile

CLIQUE = "c0ffee00-0000-5000-8000-000000000000.7"
NAMESPACE = "team-a"
NODES = ("n0", "n1", "n2", "n3")
RUNNING = ("n0", "n1")  # nodes whose daemon runs
LOST = "n2"
NON_FABRIC = "n3"


def address(node: str) -> str:
    return f"127.9.0.{int(node[1:]) + 1}"


def new_uid() -> str:
    """Unique on this machine: the process checks look for it in every command line."""
    return f"cd-{uuid.uuid4().hex[:12]}"


def member(uid: str, node: str, index: int, state: pb.MemberState = pb.MemberState.ACTIVE) -> pb.Member:
    fabric = index >= 0
    return pb.Member(
        domain_uid=uid,
        node_name=node,
        clique_id=CLIQUE if fabric else "",
        index=index,
        state=state,
        ip_address=address(node),
        namespace=NAMESPACE,
    )


def prepared(uid: str, node: str, claim: str, namespace: str = NAMESPACE) -> pb.PreparedClaim:
    return pb.PreparedClaim(
        claim_uid=claim,
        namespace=namespace,
        name=claim,
        node_name=node,
        domain_uid=uid,
        state=pb.PreparedState.PREPARE_COMPLETED,
    )


def slot_list(members: dict[str, int]) -> list[str]:
    """Slot i -> the address of the node holding index i, else the placeholder."""
    out = [slots.PLACEHOLDER_ADDRESS] * slots.MAX_SLOTS
    for node, index in members.items():
        out[index] = address(node)
    return out


def stand_in(*argv: str) -> subprocess.Popen[bytes]:
    """A real process that sleeps (with `argv` in its command line, where the checker looks)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)  # reaped: not even a zombie is left


@dataclass
class Rig:
    store: Store
    root: Path
    uid: str = field(default_factory=new_uid)
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)

    # Indices of the fabric members (the LOST one keeps its index).
    fabric = {"n0": 0, "n1": 1, LOST: 2}

    def paths(self, node: str) -> NodeLocalPaths:
        base = self.root / node
        return NodeLocalPaths(node, base / "cdi", base / "imex", base / "checkpoint.json")

    @property
    def nodes(self) -> list[NodeLocalPaths]:
        return [self.paths(n) for n in NODES]

    def dir(self, node: str) -> Path:
        return self.paths(node).imex_work_dir / self.uid

    def nodes_config(self, node: str) -> Path:
        return self.dir(node) / "nodes_config.cfg"

    def hosts(self, node: str) -> Path:
        return self.dir(node) / "hosts"

    async def check(self, quiescent: bool = True) -> list[str]:
        return await check_store_invariants(self.store, quiescent=quiescent, nodes=self.nodes)

    async def build(self) -> Rig:
        k = self.store.keys
        await self.store.put(
            k.domain(self.uid), pb.ComputeDomain(uid=self.uid, namespace=NAMESPACE, name="job-cd")
        )
        for node in NODES:
            index = self.fabric.get(node, -1)
            state = pb.MemberState.LOST if node == LOST else pb.MemberState.ACTIVE
            await self.store.put(k.member(self.uid, node), member(self.uid, node, index, state))
            await self.store.put(k.node_binding(node), pb.NodeBinding(node_name=node, domain_uid=self.uid))
            if index >= 0:
                await self.store.put(
                    k.member_index(self.uid, CLIQUE, index),
                    pb.IndexClaim(domain_uid=self.uid, clique_id=CLIQUE, index=index, node_name=node),
                )
            await self.store.put(
                k.preparation(node, f"claim-{node}"), prepared(self.uid, node, f"claim-{node}")
            )
        for node in RUNNING:
            await self.run_daemon(node)
        return self

    async def run_daemon(self, node: str) -> None:
        """The files the IMEX agent writes before the start, then the (stand-in) daemon and its status."""
        directory = self.dir(node)
        directory.mkdir(parents=True, exist_ok=True)
        self.nodes_config(node).write_text(slots.render_nodes_config_slots(self.uid, CLIQUE))
        self.hosts(node).write_text(slots.render_hosts(slot_list(self.fabric), self.uid, CLIQUE))
        proc = stand_in(str(directory / "config.cfg"))
        self.daemons[node] = proc
        write_pidfile(directory, proc.pid)
        await self.put_status(node, slot_list(self.fabric))

    async def put_status(self, node: str, peers: list[str]) -> None:
        await self.store.put(
            self.store.keys.daemon(self.uid, node),
            pb.DaemonStatus(
                domain_uid=self.uid,
                node_name=node,
                state=pb.DaemonState.READY,
                pid=self.daemons[node].pid,
                peers=peers,
                node_id=self.fabric[node],
                connected_nodes=[n for n in RUNNING if n != node],
            ),
        )

    def set_mtime(self, path: Path, when: float) -> None:
        os.utime(path, (when, when))

    async def tear_down(self) -> None:
        """Everything of the domain removed, as a complete teardown leaves it."""
        k = self.store.keys
        for proc in self.daemons.values():
            stop(proc)
        for prefix in (k.members(self.uid), k.member_indices(self.uid), k.daemons(self.uid)):
            await self.store.delete_prefix(prefix)
        await self.store.delete(k.domain(self.uid))
        for node in NODES:
            await self.store.delete(k.node_binding(node))
            await self.store.delete(k.preparation(node, f"claim-{node}"))
            with contextlib.suppress(FileNotFoundError):
                for f in self.dir(node).iterdir():
                    f.unlink()
                self.dir(node).rmdir()
            self.paths(node).cdi_root.mkdir(parents=True, exist_ok=True)
            self.paths(node).imex_work_dir.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        for proc in [*self.daemons.values(), *self.others]:
            stop(proc)
