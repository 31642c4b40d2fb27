"""The `cdsim` supervisor: runs a whole simulated cluster as real processes.

One supervisor per state directory (it holds the directory's lock for its whole life). It
starts etcd, then the placement advisor, the controller replicas and one node agent per node
(forked from a pre-imported fork server, see `tools.cdsim.zygote`), waits until all answer
/healthz, and then keeps them running the way Kubernetes would: a process that dies is started
again after a short delay (a DaemonSet / Deployment restart). It publishes what runs in
`run.json` and takes orders on a unix control socket (JSON lines):

    {"op": "status"}                       -> {"ok": true, "state": {...run.json...}}
    {"op": "kill", "process": "agent-rack0-tray3", "restart_in_s": 8}   (restart_in_s optional)
                                           -> {"ok": true, "pid": 123, "restart_in_s": 8.0}
    {"op": "kill-node", "node": "rack0-tray3", "restart_in_s": 30}   (IMEX agent, daemons, plugin)
                                           -> {"ok": true, "killed": {...}, "restart_in_s": 30.0}
    {"op": "restart-etcd"}                 -> {"ok": true, "down_ms": 850}
    {"op": "partition-etcd", "node": "rack0-tray3", "seconds": 8}   (cut the node's etcd gate)
                                           -> {"ok": true, "connections_cut": 4, "seconds": 8.0}
    {"op": "shutdown"}                     -> {"ok": true}   (then stops everything and exits)

Run by `cdsim up`; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from libs.runtime.backoff import Backoff
from libs.runtime.logging import configure_logging
from tools.cdsim import proc_scan
from tools.cdsim.credentials import ETCD_SERVER, Credentials, enable_etcd_auth
from tools.cdsim.etcd_gate import EtcdGate
from tools.cdsim.kube_plane import PRELOAD_MODULES as KUBE_PRELOAD_MODULES
from tools.cdsim.kube_plane import STARTUP_TIMEOUT_S as KUBE_STARTUP_TIMEOUT_S
from tools.cdsim.kube_plane import KubeMode
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import ProcessInfo, RunState, SimConfig
from tools.cdsim.services import (
    AGENT_KIND,
    IMEX_AGENT_KIND,
    PRELOAD_MODULES,
    Ports,
    ServiceSpec,
    all_specs,
    with_credentials,
)
from tools.dashboard.cdsim_hook import dashboard_port, dashboard_spec
from tools.etcd.server import EtcdServer
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription

log = structlog.get_logger(__name__)

STARTUP_TIMEOUT_S = 120.0
HEALTH_POLL_INTERVAL_S = 0.1
HEALTH_CHECK_PERIOD_S = 3.0
HEALTH_REQUEST_TIMEOUT_S = 2.0
STOP_GRACE_S = 10.0
# A process that ran at least this long before dying counts as a fresh failure (no crash loop).
STABLE_RUN_S = 30.0
RUN_FILE_DEBOUNCE_S = 0.2
ETCD_RESTART_STOP_GRACE_S = 1.0


def _now_ms() -> int:
    return int(time.time() * 1000)


def describe_exit(code: int | None, sig: int) -> str:
    if sig:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with code {code}"


def _check_delay(delay: Any) -> str:
    """'' when `delay` is a valid restart delay (or absent), else what is wrong with it."""
    if delay is None or (isinstance(delay, int | float) and 0 <= delay <= 3600):
        return ""
    return f"restart_in_s must be a number of seconds in [0, 3600], got {delay!r}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ZygoteClient:
    """Talks to the fork server: spawn requests out, pids and exit events in."""

    def __init__(self, on_exit: Callable[[int, int | None, int], None]) -> None:
        self.on_exit = on_exit
        self.process: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None

    async def start(self, layout: StateLayout, extra_preload: tuple[str, ...] = ()) -> None:
        log_file = open(layout.log_file("forkserver"), "ab")  # noqa: ASYNC230 - handed to the child
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tools.cdsim.zygote",
                "--preload",
                ",".join((*PRELOAD_MODULES, *extra_preload)),
                "--state-dir",
                str(layout.root),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                cwd=str(layout.root),
            )
        finally:
            log_file.close()
        self._reader = asyncio.create_task(self._read(), name="zygote-reader")

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                break
            try:
                message = json.loads(line)
            except ValueError:
                log.warning("unreadable line from fork server", line=line[:200])
                continue
            if message.get("event") == "exit":
                self.on_exit(int(message["pid"]), message.get("code"), int(message.get("signal") or 0))
                continue
            future = self._pending.pop(message.get("id", -1), None)
            if future is None or future.done():
                continue
            if "pid" in message:
                future.set_result(int(message["pid"]))
            else:
                future.set_exception(RuntimeError(str(message.get("error", "fork server refused"))))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError("fork server exited"))
        self._pending.clear()

    async def spawn(self, spec: ServiceSpec, log_path: Path) -> int:
        assert self.process is not None and self.process.stdin is not None
        self._next_id += 1
        rid = self._next_id
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        request = {
            "id": rid,
            "op": "spawn",
            "name": spec.name,
            "target": spec.target,
            "argv": spec.argv,
            "log": str(log_path),
            "env": spec.env,
        }
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        await self.process.stdin.drain()
        return await asyncio.wait_for(future, timeout=30.0)

    async def close(self) -> None:
        if self.process is None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), timeout=STOP_GRACE_S)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, timeout=2.0)


@dataclass
class Service:
    spec: ServiceSpec
    info: ProcessInfo
    started_at: float = 0.0
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    restart: asyncio.TimerHandle | None = None
    crash_backoff: Backoff = field(default_factory=lambda: Backoff(initial=1.0, cap=15.0))
    # Set by a `kill` request that asks for a longer outage than the usual restart delay.
    next_restart_delay_s: float | None = None


class StartupFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, layout: StateLayout, config: SimConfig, cluster: ClusterDescription) -> None:
        self.layout = layout
        self.config = config
        self.cluster = cluster
        self.state = RunState(phase="starting", supervisor_pid=os.getpid(), started_unix_ms=_now_ms())
        etcd_port = config.etcd_client_port or free_port()
        self.ports = Ports(
            etcd=etcd_port,
            advisor_grpc=free_port(),
            advisor_health=free_port(),
            controller_health=tuple(free_port() for _ in range(config.controllers)),
            node_etcd={node: free_port() for node in cluster.node_names()},
        )
        # One etcd gate per node (`fault partition-etcd`), alive as long as the supervisor.
        self.gates = {node: EtcdGate(node, port, etcd_port) for node, port in self.ports.node_etcd.items()}
        # A secured run: etcd requires a client certificate of the run's CA (tools.cdsim.credentials).
        self.credentials = Credentials(layout.pki_dir) if config.secure else None
        serving = self.credentials.pair(ETCD_SERVER) if self.credentials else None
        self.etcd = EtcdServer(
            data_dir=layout.etcd_dir,
            client_port=self.ports.etcd,
            peer_port=config.etcd_peer_port or free_port(),
            log_path=layout.log_file("etcd"),
            cert_file=serving.cert if serving else None,
            key_file=serving.key if serving else None,
            trusted_ca_file=self.credentials.ca_file if self.credentials else None,
            client_cert_auth=self.credentials is not None,
        )
        self.zygote = ZygoteClient(self._on_exit)
        # `up --kubernetes`: the control plane, a kubelet per node, services in Kubernetes mode.
        self.kube = KubeMode(layout, config, cluster) if config.kubernetes else None
        self.services: dict[str, Service] = {}
        self.by_pid: dict[int, Service] = {}
        self.stopping = False
        self.shutdown_requested = asyncio.Event()
        self._etcd_busy = asyncio.Lock()
        self._dirty = asyncio.Event()
        self._startup_failure: str | None = None
        self._http: aiohttp.ClientSession | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    # ---- run.json --------------------------------------------------------------------------

    def mark_dirty(self) -> None:
        self._dirty.set()

    async def _write_run_file(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self.state.save(self.layout)
            await asyncio.sleep(RUN_FILE_DEBOUNCE_S)

    # ---- processes -------------------------------------------------------------------------

    async def _start_service(self, service: Service) -> None:
        service.restart = None
        if self.stopping:
            return
        try:
            pid = await self.zygote.spawn(service.spec, self.layout.log_file(service.spec.name))
        except (RuntimeError, TimeoutError, OSError) as exc:
            log.error("cannot start process", process=service.spec.name, error=str(exc))
            service.info.last_exit = f"could not start: {exc}"
            self._schedule_restart(service, service.crash_backoff.next_delay())
            return
        service.exited.clear()
        service.started_at = time.monotonic()
        service.info.pid = pid
        service.info.running = True
        service.info.healthy = False
        self.by_pid[pid] = service
        log.info("process started", process=service.spec.name, pid=pid)
        self.mark_dirty()

    def _schedule_restart(self, service: Service, delay: float) -> None:
        if self.stopping:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            service.info.restarts += 1
            task = asyncio.create_task(self._start_service(service), name=f"restart-{service.spec.name}")
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

        service.restart = loop.call_later(delay, fire)

    def _on_exit(self, pid: int, code: int | None, sig: int) -> None:
        service = self.by_pid.pop(pid, None)
        if service is None:
            return
        reason = describe_exit(code, sig)
        service.info.running = False
        service.info.healthy = False
        service.info.pid = 0
        service.info.last_exit = reason
        service.exited.set()
        self.mark_dirty()
        if self.stopping:
            return
        log.warning("process exited", process=service.spec.name, pid=pid, reason=reason)
        if self.state.phase == "starting":
            tail = log_tail(self.layout.log_file(service.spec.name))
            self._startup_failure = f"{service.spec.name} {reason} during start; its log ends with:\n{tail}"
            return
        ran_for = time.monotonic() - service.started_at
        if service.next_restart_delay_s is not None:
            delay = service.next_restart_delay_s
            service.next_restart_delay_s = None
        elif ran_for >= STABLE_RUN_S or sig == signal.SIGKILL:
            service.crash_backoff.reset()
            delay = service.spec.restart_delay_s
        else:
            delay = max(service.spec.restart_delay_s, service.crash_backoff.next_delay())
        log.info("restarting process later", process=service.spec.name, delay_s=round(delay, 2))
        self._schedule_restart(service, delay)

    async def _healthy(self, service: Service) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(service.spec.health_url) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _wait_all_healthy(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        pending = list(self.services.values())
        while pending:
            if self._startup_failure:
                raise StartupFailed(self._startup_failure)
            if loop.time() > deadline:
                names = ", ".join(s.spec.name for s in pending[:5])
                more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
                first = pending[0].spec.name
                raise StartupFailed(
                    f"not healthy within {STARTUP_TIMEOUT_S:.0f}s: {names}{more}; "
                    f"{first}'s log ends with:\n{log_tail(self.layout.log_file(first))}"
                )
            # Taken once: a service may stop running while its health is being asked.
            running = [s for s in pending if s.info.running]
            results = await asyncio.gather(*(self._healthy(s) for s in running))
            for service, ok in zip(running, results, strict=True):
                if ok:
                    service.info.healthy = True
                    self.mark_dirty()
            pending = [s for s in pending if not s.info.healthy]
            if pending:
                await asyncio.sleep(HEALTH_POLL_INTERVAL_S)

    async def _check_health_forever(self) -> None:
        semaphore = asyncio.Semaphore(16)

        async def check(service: Service) -> None:
            async with semaphore:
                ok = service.info.running and await self._healthy(service)
            if ok != service.info.healthy:
                service.info.healthy = ok
                self.mark_dirty()

        while True:
            await asyncio.gather(*(check(s) for s in self.services.values()))
            await asyncio.sleep(HEALTH_CHECK_PERIOD_S)

    # ---- etcd ------------------------------------------------------------------------------

    async def _start_etcd(self) -> None:
        await asyncio.to_thread(self.etcd.start)
        info = self.state.processes["etcd"]
        info.pid = self.etcd.process.pid if self.etcd.process else 0
        info.running = info.healthy = True
        self.mark_dirty()

    async def _watch_etcd(self) -> None:
        """Start etcd again if it dies on its own (not while `restart-etcd` is at work)."""
        info = self.state.processes["etcd"]
        while True:
            await asyncio.sleep(0.5)
            process = self.etcd.process
            if self._etcd_busy.locked() or process is None or process.poll() is None:
                continue
            async with self._etcd_busy:
                info.running = info.healthy = False
                info.last_exit = describe_exit(process.returncode, 0)
                self.mark_dirty()
                log.warning("etcd exited; starting it again", reason=info.last_exit)
                await asyncio.sleep(1.0)
                info.restarts += 1
                await self._start_etcd()

    async def restart_etcd(self) -> int:
        async with self._etcd_busy:
            began = time.monotonic()
            info = self.state.processes["etcd"]
            info.running = info.healthy = False
            self.mark_dirty()
            # etcd's graceful stop waits up to ~7 s for open watch streams; a restart should not.
            await asyncio.to_thread(self.etcd.stop, ETCD_RESTART_STOP_GRACE_S)
            info.last_exit = "stopped by cdsim fault restart-etcd"
            info.restarts += 1
            await self._start_etcd()
            return int((time.monotonic() - began) * 1000)

    # ---- control socket --------------------------------------------------------------------

    async def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op in ("status", "ping"):
            return {"ok": True, "state": json.loads(self.state.to_json())}
        if op == "kill":
            name = str(request.get("process", ""))
            service = self.services.get(name)
            if service is None:
                return {"ok": False, "error": f"no process named {name!r}"}
            pid = service.info.pid
            if not service.info.running or not pid:
                return {"ok": False, "error": f"{name} is not running (restart pending)"}
            delay = request.get("restart_in_s")
            problem = _check_delay(delay)
            if problem:
                return {"ok": False, "error": problem}
            self._kill_service(service, None if delay is None else float(delay))
            restart_in = service.spec.restart_delay_s if delay is None else float(delay)
            return {"ok": True, "pid": pid, "restart_in_s": restart_in}
        if op == "kill-node":
            return self._kill_node(str(request.get("node", "")), request.get("restart_in_s"))
        if op == "restart-etcd":
            down_ms = await self.restart_etcd()
            return {"ok": True, "down_ms": down_ms}
        if op == "partition-etcd":
            return self._partition_etcd(str(request.get("node", "")), request.get("seconds"))
        if op == "shutdown":
            self.shutdown_requested.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _kill_service(self, service: Service, restart_in_s: float | None) -> None:
        if restart_in_s is not None:
            service.next_restart_delay_s = restart_in_s
        os.kill(service.info.pid, signal.SIGKILL)
        log.info("killed on request", process=service.spec.name, pid=service.info.pid)

    def _kill_node(self, node: str, delay: Any) -> dict[str, Any]:
        """The whole node dies: its IMEX agent, its IMEX daemons and its kubelet plugin.

        The IMEX agent goes first so that it cannot restart a daemon in between; with the daemons
        gone nothing listens on the node's address any more. Both programs come back after
        `restart_in_s` (default: the usual restart delay), like a rebooted node's DaemonSets.
        """
        problem = _check_delay(delay)
        if problem:
            return {"ok": False, "error": problem}
        node_services = [s for s in self.services.values() if s.spec.node == node]
        if not node_services:
            return {"ok": False, "error": f"no node named {node!r}"}
        node_services.sort(key=lambda s: s.spec.kind != IMEX_AGENT_KIND)
        killed: dict[str, int] = {}
        for service in node_services:
            if service.info.running and service.info.pid:
                killed[service.spec.name] = service.info.pid
                self._kill_service(service, None if delay is None else float(delay))
            elif service.restart is not None and delay is not None:
                service.restart.cancel()  # already down: keep it down as long as asked
                self._schedule_restart(service, float(delay))
            if service.spec.kind == IMEX_AGENT_KIND:
                daemons = proc_scan.imex_daemons_under(self.layout.node(node).imex_dir)
                for pid in proc_scan.kill_all(daemons, signal.SIGKILL):
                    killed[f"imex-daemon-{pid}"] = pid
        restart_in = max((s.spec.restart_delay_s for s in node_services), default=0.0)
        return {"ok": True, "killed": killed, "restart_in_s": restart_in if delay is None else float(delay)}

    def _partition_etcd(self, node: str, seconds: Any) -> dict[str, Any]:
        """Cut the node's programs off etcd for `seconds` (its IMEX daemons and peer links stay)."""
        gate = self.gates.get(node)
        if gate is None:
            return {"ok": False, "error": f"no node named {node!r}"}
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 < seconds <= 3600:
            return {"ok": False, "error": f"seconds must be a number in (0, 3600], got {seconds!r}"}
        cut = gate.partition(float(seconds))
        return {"ok": True, "connections_cut": cut, "seconds": float(seconds)}

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=10.0)
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("request must be an object")
                response = await self._handle(request)
            except ValueError as exc:
                response = {"ok": False, "error": f"bad request: {exc}"}
            except Exception as exc:
                log.exception("control request failed")
                response = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            writer.write((json.dumps(response) + "\n").encode())
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    # ---- lifecycle -------------------------------------------------------------------------

    def _register_services(self) -> None:
        self.state.etcd_endpoint = self.etcd.endpoint
        self.state.advisor_endpoint = f"127.0.0.1:{self.ports.advisor_grpc}"
        self.state.tls_dir = str(self.credentials.directory) if self.credentials else ""
        self.state.processes["etcd"] = ProcessInfo(
            name="etcd", kind="etcd", health_url=f"{self.etcd.scheme}://{self.etcd.endpoint}/health"
        )
        specs = all_specs(self.cluster, self.layout, self.config, self.ports)
        # The live dashboard (tools/dashboard): supervised like any service, its URL in run.json.
        dashboard = dashboard_spec(self.layout, self.config, self.etcd.endpoint, dashboard_port())
        if self.credentials is not None:
            dashboard = with_credentials(dashboard, self.credentials, advisor_mtls=False)
        specs.append(dashboard)
        if self.kube is not None:
            specs = self.kube.adapt(specs)
            self.state.kubeconfig = str(self.kube.kubeconfig)
            self.state.kube_bin_dir = str(self.kube.bin_dir)
        for spec in specs:
            info = ProcessInfo(name=spec.name, kind=spec.kind, health_url=spec.health_url, node=spec.node)
            self.services[spec.name] = Service(spec=spec, info=info)
            self.state.processes[spec.name] = info

    async def run(self) -> int:
        self.layout.logs_dir.mkdir(parents=True, exist_ok=True)
        self._register_services()
        self.state.save(self.layout)
        with contextlib.suppress(FileNotFoundError):
            self.layout.control_socket.unlink()
        server = await asyncio.start_unix_server(self._serve_client, path=str(self.layout.control_socket))
        os.chmod(self.layout.control_socket, 0o600)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown_requested.set)
        background: list[asyncio.Task[Any]] = [asyncio.create_task(self._write_run_file(), name="run-file")]
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HEALTH_REQUEST_TIMEOUT_S))
        code = 0
        try:
            if await self._start_unless_shutdown(background):
                log.info("cluster ready", nodes=self.cluster.node_count)
                await self.shutdown_requested.wait()
        except StartupFailed as exc:
            log.error("cluster failed to start", error=str(exc))
            self.state.phase = "failed"
            self.state.error = str(exc)
            self.state.save(self.layout)
            code = 1
        finally:
            server.close()
            await self._stop(background)
            await self._http.close()
            if code == 0:
                self.state.phase = "stopped"
            self.state.save(self.layout)
            with contextlib.suppress(FileNotFoundError):
                self.layout.control_socket.unlink()
        return code

    async def _start_unless_shutdown(self, background: list[asyncio.Task[Any]]) -> bool:
        """Start everything; False when a shutdown (`cdsim down`, SIGTERM) came first: a start with
        Kubernetes takes minutes, and down must not wait for it."""
        start = asyncio.create_task(self._start(background), name="start")
        shutdown = asyncio.create_task(self.shutdown_requested.wait(), name="shutdown-wait")
        await asyncio.wait({start, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        shutdown.cancel()
        if not start.done():
            log.info("shutdown requested during start")
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return False
        start.result()  # StartupFailed
        return True

    async def _start(self, background: list[asyncio.Task[Any]]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (KUBE_STARTUP_TIMEOUT_S if self.kube else STARTUP_TIMEOUT_S)
        starts = [
            self._start_etcd(),
            self.zygote.start(self.layout, KUBE_PRELOAD_MODULES if self.kube else ()),
        ]
        if self.kube is not None:
            starts.append(self.kube.start())
        results = await asyncio.gather(*starts, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise StartupFailed(f"could not start etcd, the fork server or Kubernetes: {result}")
        if self.credentials is not None:
            try:
                await enable_etcd_auth(self.credentials, self.etcd.endpoint)
            except Exception as exc:  # any failure here fails the start, with its reason
                raise StartupFailed(f"could not enable etcd's authentication: {exc!r}") from None
        background.append(asyncio.create_task(self._watch_etcd(), name="etcd-watch"))
        try:
            await asyncio.gather(*(gate.start() for gate in self.gates.values()))
        except OSError as exc:
            raise StartupFailed(f"could not open the nodes' etcd gates: {exc}") from None
        # In Kubernetes mode the kubelets registered their Nodes in kube.start(), before any plugin
        # publishes a slice, as on a real node.
        await asyncio.gather(*(self._start_service(s) for s in self.services.values()))
        if self._startup_failure:
            raise StartupFailed(self._startup_failure)
        await self._wait_all_healthy(deadline)
        if self.kube is not None:
            try:
                await self.kube.wait_usable(deadline)
            except RuntimeError as exc:
                raise StartupFailed(str(exc)) from None
        self.state.phase = "ready"
        self.state.ready_unix_ms = _now_ms()
        self.state.save(self.layout)
        background.append(asyncio.create_task(self._check_health_forever(), name="health"))

    async def _terminate(self, services: list[Service]) -> None:
        for service in services:
            if service.restart is not None:
                service.restart.cancel()
                service.restart = None
        running = [s for s in services if s.info.running and s.info.pid]
        for service in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(service.info.pid, signal.SIGTERM)
        waits: list[Awaitable[Any]] = [s.exited.wait() for s in running]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout=STOP_GRACE_S)
        except TimeoutError:
            for service in running:
                if service.info.running and service.info.pid:
                    log.warning("process ignored SIGTERM; killing it", process=service.spec.name)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(service.info.pid, signal.SIGKILL)

    async def _stop(self, background: list[asyncio.Task[Any]]) -> None:
        self.stopping = True
        self.state.phase = "stopping" if self.state.phase != "failed" else "failed"
        self.state.save(self.layout)
        log.info("stopping the cluster")
        # Node programs first (the IMEX daemons they leave running are killed with the leftovers
        # below), then the control plane; etcd last.
        node_kinds = (AGENT_KIND, IMEX_AGENT_KIND)
        await self._terminate([s for s in self.services.values() if s.spec.kind in node_kinds])
        await self._terminate([s for s in self.services.values() if s.spec.kind not in node_kinds])
        await self.zygote.close()
        if self.kube is not None:
            await self.kube.stop()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.gather(*(gate.close() for gate in self.gates.values()))
        async with self._etcd_busy:
            await asyncio.to_thread(self.etcd.stop)
        self.state.processes["etcd"].running = False
        leftovers = [
            p
            for p in proc_scan.cluster_processes(self.layout)
            if proc_scan.SUPERVISOR_MARKER not in p.command
        ]
        if leftovers:
            log.warning("killing leftover processes", pids=[p.pid for p in leftovers])
            proc_scan.kill_all(leftovers)
        for service in self.services.values():
            service.info.running = service.info.healthy = False
            service.info.pid = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cdsim-supervisor", description="Supervisor of a cdsim cluster.")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--lock-fd", type=int, default=-1, help="fd of the state dir lock, held for life")
    args = parser.parse_args(argv)
    configure_logging("json", "info")
    layout = StateLayout.at(args.state_dir)
    if args.lock_fd < 0:
        from tools.cdsim.run_state import try_lock

        if try_lock(layout) is None:
            print(f"another supervisor runs in {layout.root}", file=sys.stderr)
            return 1
    config = SimConfig.load(layout)
    cluster = ClusterDescription.load(layout.cluster_file)
    os.chdir(layout.root)
    return asyncio.run(Supervisor(layout, config, cluster).run())


if __name__ == "__main__":
    raise SystemExit(main())
