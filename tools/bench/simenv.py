"""The processes a simulation benchmark runs against: a private etcd, a `cd-controller`, a
scale-mode host of node agents. Each is a real process, started and stopped here.

Benchmarks measure at production settings: etcd keeps its data on disk and fsyncs it (as a
control plane's etcd does), and the node directories (kubelet dir with the checkpoint, IMEX work
dirs) are on disk as on a node. :func:`scratch_dir` therefore avoids tmpfs, and
:func:`storage_settings` says what a run actually got, for the results. A scale host keeps each
node's CDI root under its node directory, so there it is on disk too (on a node, ``/var/run/cdi``
is tmpfs: the stricter choice).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT
from tools import launch
from tools.cdsim import proc_scan
from tools.etcd.server import EtcdServer, etcd_binary
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription

_SHM = Path("/dev/shm")
# Conventionally disk-backed and persistent (FHS), unlike /tmp, which some systems mount as tmpfs.
_DISK_TMP = Path("/var/tmp")
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
# Loopback blocks (second octet) tried first: cdsim uses 1, its tests 77-78, the e2e tests 2-99,
# the node-agent tests 100-250; 251-255 are left to the benchmarks.
_PREFERRED_BLOCKS = (251, 252, 253, 254, 255)


def _scratch_parent() -> Path:
    return _DISK_TMP if _DISK_TMP.is_dir() and not on_tmpfs(_DISK_TMP) else Path(tempfile.gettempdir())


def scratch_dir(prefix: str) -> Path:
    """A fresh directory on disk (``/var/tmp`` if it is a disk there, else the temp directory)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_scratch_parent()))


def shm_dir(prefix: str) -> Path:
    """A fresh directory on tmpfs (``/dev/shm``), for what is tmpfs on a node: the CDI root."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_SHM if _SHM.is_dir() else None))


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (its longest mount point in /proc/self/mounts)."""
    target = path.resolve()
    best, kind = -1, "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # Mount points escape blanks as octal (\040).
        mount = Path(fields[1].replace("\\040", " "))
        if target.is_relative_to(mount) and len(mount.parts) > best:
            best, kind = len(mount.parts), fields[2]
    return kind


def on_tmpfs(path: Path) -> bool:
    return filesystem_type(path) in _MEMORY_FS


def fs_label(path: Path) -> str:
    """'tmpfs' or 'disk (<type>)', as the results record it."""
    kind = filesystem_type(path)
    return "tmpfs" if kind in _MEMORY_FS else f"disk ({kind})"


def etcd_fsync() -> bool:
    """Whether a private etcd started here fsyncs (tools/etcd/server.py: off only on request)."""
    return os.environ.get("CD_ETCD_UNSAFE_NO_FSYNC") != "1"


def storage_settings(base: Path | None = None) -> dict[str, Any]:
    """Where a run under `base` (default: where :func:`scratch_dir` puts one) keeps etcd's data
    and the node directories, whether etcd fsyncs, and the node agent's checkpoint durability
    (its default: nothing here changes it)."""
    where = fs_label(base if base is not None else _scratch_parent())
    return {
        "etcd_data": where,
        "etcd_fsync": etcd_fsync(),
        "node_dirs": where,
        "checkpoint_fsync": checkpoint_fsync_default(),
    }


def checkpoint_fsync_default() -> bool:
    """The node agent's shipped `checkpoint_fsync` (services/nodeagent/settings.py)."""
    from services.nodeagent.settings import AgentSettings

    return bool(next(f.default for f in dataclasses.fields(AgentSettings) if f.name == "checkpoint_fsync"))


def _block_free(cluster: ClusterDescription) -> bool:
    for node in cluster.nodes():
        for port in (DEFAULT_SERVER_PORT, DEFAULT_CMD_PORT):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((node.address, port))
                except OSError:
                    return False
    return True


def free_address_block(racks: int, trays_per_rack: int = 18) -> int:
    """A loopback block on which no node address of such a cluster has its IMEX ports in use."""
    for block in (*_PREFERRED_BLOCKS, *range(2, 100)):
        try:
            cluster = ClusterDescription(racks=racks, trays_per_rack=trays_per_rack, address_block=block)
        except ValueError:
            continue
        if _block_free(cluster):
            return block
    raise RuntimeError("no loopback address block with free IMEX ports")


@contextmanager
def private_etcd(base: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=base / "etcd", binary=etcd_binary())
    server.start()
    try:
        yield server
    finally:
        server.destroy()


# ---- the controller -------------------------------------------------------------------------------


@dataclass
class ControllerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def metrics(self) -> dict[str, float]:
        return launch.metrics(self.port)

    def events_handled(self, metrics: dict[str, float]) -> float:
        """Store events the controller handled (its own counter, over every kind)."""
        return sum(v for k, v in metrics.items() if k.startswith("cd_controller_store_events_total{"))

    def rss_mb(self) -> tuple[float, float]:
        """(current, peak) resident set size of the controller process, MiB."""
        return process_rss_mb(self.proc.pid)

    def stop(self) -> None:
        launch.stop_process(self.proc)


def start_controller(
    endpoint: str,
    prefix: str,
    workdir: Path,
    timeout_s: float = 60.0,
    mesh_tls: bool = True,
    level: str | None = None,
    settings: Sequence[str] = (),
) -> ControllerProcess:
    """A `cd-controller` (simulation mode) that has become leader; `mesh_tls`: its domains' mode;
    `level`: its log level (default `log_level()`); `settings`: more of its flags."""
    port = free_port()
    started = launch.start_service(
        "controller",
        [
            f"--etcd-endpoint={endpoint}", f"--etcd-prefix={prefix}",
            "--identity=bench-controller", "--health-host=127.0.0.1", f"--health-port={port}",
            "--log-format=json", f"--log-level={level or log_level()}", f"--imex-mesh-tls={str(mesh_tls).lower()}",
            *settings,
        ],
        workdir / "controller.log",
    )  # fmt: skip
    controller = ControllerProcess(started.proc, port, started.log)
    started.wait_healthy(lambda: controller.metrics().get("cd_controller_leader") == 1.0, timeout_s, "leader")
    return controller


# ---- the scale host ---------------------------------------------------------------------------------


@dataclass
class HostProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    report_file: Path
    report: dict[str, Any]

    @property
    def sockets(self) -> dict[str, str]:
        return dict(self.report["nodes"])

    def status(self) -> dict[str, Any]:
        """The host's latest report (rewritten every second: memory, loop lag, lease losses)."""
        data: dict[str, Any] = json.loads(self.report_file.read_text())
        return data

    def stop(self) -> None:
        launch.stop_process(self.proc, grace_s=60.0)


@dataclass
class HostGroup:
    """The scale hosts of one run (one per shard of the nodes), seen as one."""

    hosts: list[HostProcess]

    @property
    def sockets(self) -> dict[str, str]:
        return {node: sock for host in self.hosts for node, sock in host.sockets.items()}

    @property
    def pids(self) -> list[int]:
        return [host.proc.pid for host in self.hosts]

    def report(self, key: str) -> list[Any]:
        """`key` of every host's ready report."""
        return [host.report[key] for host in self.hosts]

    def status(self) -> dict[str, Any]:
        """The latest reports combined: the worst loop lag, the sum of lease losses."""
        reports = [host.status() for host in self.hosts]
        return {
            "max_loop_lag_s": max(r["max_loop_lag_s"] for r in reports),
            "lease_losses": sum(r["lease_losses"] for r in reports),
        }

    def stop(self) -> None:
        for host in self.hosts:
            host.proc.send_signal(signal.SIGTERM)
        for host in self.hosts:
            host.stop()


def start_host(
    endpoint: str,
    prefix: str,
    workdir: Path,
    *,
    racks: int,
    nodes: int,
    address_block: int,
    inventory_only: bool = False,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 600.0,
    processes: int = 1,
) -> HostGroup:
    """`processes` `tools.sim.scalesim` processes (each hosting a contiguous part of the nodes, so
    that they use as many cores), returned once every agent serves (all ready files written)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    starting: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    try:
        for shard in range(processes):
            suffix = "" if processes == 1 else f"-{shard}"
            ready, log = workdir / f"host-ready{suffix}.json", workdir / f"host{suffix}.log"
            argv = [
                sys.executable, "-m", "tools.sim.scalesim",
                f"--racks={racks}", f"--nodes={nodes}", f"--shard={shard}/{processes}",
                f"--address-block={address_block}",
                f"--seed=bench-{workdir.name}", f"--state-dir={workdir / 'n'}",
                f"--etcd-endpoint={endpoint}", f"--etcd-prefix={prefix}", f"--ready-file={ready}",
                f"--start-timeout-s={timeout_s}",
                *(["--inventory-only"] if inventory_only else []),
                f"--log-level={log_level()}",
                *extra_args,
            ]  # fmt: skip
            starting.append((launch.spawn("scale host", argv, log).proc, log, ready))
        hosts: list[HostProcess] = []
        deadline = time.monotonic() + timeout_s + 30
        for proc, log, ready in starting:
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"scale host exited {proc.returncode}: {log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"scale host not serving within {timeout_s:.0f}s: {log.read_text()[-3000:]}"
                    )
                time.sleep(0.1)
            hosts.append(HostProcess(proc, log, ready, json.loads(ready.read_text())))
    except BaseException:
        for proc, _, _ in starting:
            launch.stop_process(proc)
        raise
    return HostGroup(hosts)


def log_level() -> str:
    """Our processes' log level in a benchmark: warning, or CD_BENCH_LOG_LEVEL (info or debug gives
    per-node timelines, at a cost in CPU that changes the figures)."""
    level = os.environ.get("CD_BENCH_LOG_LEVEL", "warning")
    if level not in ("debug", "info", "warning", "error"):
        raise ValueError(f"CD_BENCH_LOG_LEVEL must be debug, info, warning or error, got {level!r}")
    return level


def remove_tree(path: Path) -> None:
    """Remove a run's scratch directory; CD_BENCH_KEEP=1 keeps it (its logs) and says where."""
    if os.environ.get("CD_BENCH_KEEP") == "1":
        print(f"[bench] kept {path} (CD_BENCH_KEEP=1)", file=sys.stderr, flush=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def kill_leftover_daemons(base: Path) -> int:
    """SIGKILL simulated IMEX daemons still running from under `base`; how many there were.
    (A stopped host stops its daemons; any left over would hold loopback ports for the next run.)"""
    return len(proc_scan.kill_all(proc_scan.imex_daemons_under(base)))


def process_rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of a process, MiB."""
    values = {"VmRSS:": 0.0, "VmHWM:": 0.0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            head = line.split(maxsplit=1)[0] if line else ""
            if head in values:
                values[head] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return values["VmRSS:"], values["VmHWM:"]
