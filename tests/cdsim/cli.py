"""Driving `cdsim` from tests as a user does (subprocesses), and watching a domain while faults run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.watch import Resync, watch_prefix
from tools.cdsim.jobs import open_store
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState


def cdsim(state_dir: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cdsim.main", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def status(state_dir: Path) -> dict[str, Any]:
    return dict(json.loads(ok(cdsim(state_dir, "status", "--json"))))


def run_state(state_dir: Path) -> RunState:
    state = RunState.load(StateLayout.at(state_dir))
    assert state is not None
    return state


async def daemon_instances(state_dir: Path, uid: str) -> dict[str, str]:
    store = open_store(run_state(state_dir))
    async with store:
        records, _ = await store.list(store.keys.daemons(uid), pb.DaemonStatus)
    return {r.value.node_name: r.value.instance for r in records}


@dataclass
class ReadyWatch:
    """Every status the job's domain record shows while a fault runs (a store watch in a thread)."""

    state_dir: Path
    uid: str
    seen: list[tuple[float, str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _started: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ReadyWatch:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the domain watch did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def not_ready(self) -> list[tuple[float, str, str]]:
        return [s for s in self.seen if s[1] != "READY"]

    async def _run(self) -> None:
        store = open_store(run_state(self.state_dir))
        async with store:
            task = asyncio.create_task(self._follow(store))
            await asyncio.to_thread(self._stop.wait)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _follow(self, store: Any) -> None:
        async for event in watch_prefix(store, store.keys.domain(self.uid), pb.ComputeDomain):
            records = event.items if isinstance(event, Resync) else []
            values = [r.value for r in records] if isinstance(event, Resync) else [event.value]
            for domain in values:
                if domain is not None and domain.uid == self.uid:
                    reason = domain.status.conditions[0].reason if domain.status.conditions else ""
                    self.seen.append((time.monotonic(), domain.status.status.name, reason))
            self._started.set()
