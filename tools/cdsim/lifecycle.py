"""`cdsim up` and `cdsim down`: start the supervisor in the background, and stop it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from libs.imex.driver import SIMULATED_DRIVER_VERSION
from tools.cached_tool import BuildError
from tools.cdsim import control, credentials, proc_scan
from tools.cdsim.kube_plane import check_inotify_budget
from tools.cdsim.layout import MAX_UNIX_SOCKET_PATH, StateLayout
from tools.cdsim.run_state import (
    CONFIG_FILE_NAME,
    RunState,
    SimConfig,
    pid_alive,
    supervisor_running,
    try_lock,
)
from tools.cdsim.services import AGENT_HEALTH_PORT
from tools.controlplane.binaries import Binaries, ensure_binaries, ensure_node_binaries
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs
from tools.sim.kubelet.addresses import NodeAddressError, node_ip, remove_leftovers
from tools.sim.kubelet.inotify import InotifyBudgetExceeded

UP_TIMEOUT_S = 150.0
# `up --kubernetes` also starts a control plane (tools.cdsim.kube_plane.STARTUP_TIMEOUT_S, plus slack).
KUBE_UP_TIMEOUT_S = 420.0
REPO_ROOT = Path(__file__).resolve().parents[2]
DOWN_TIMEOUT_S = 60.0


class CommandError(RuntimeError):
    """A user-facing failure: the message is printed as is and the command exits 1."""


@dataclass(frozen=True)
class UpOptions:
    racks: int = 1
    trays: int = 18
    partitions_per_rack: int = 1
    address_block: int = 1
    log_level: str = "info"
    mesh: str = "tls"  # tls | plaintext: the controller's mode for new domains
    mesh_certificate_validity_s: float = 24 * 3600.0
    kubernetes: bool = False  # a real control plane, a real kubelet per node, services in Kubernetes mode
    secure: bool = True  # etcd with TLS and auth, the advisor with mutual TLS (`up --plaintext`: off)
    driver_version: str = ""  # every node's (NVML) driver version; "" = the simulation's default
    node_driver_versions: tuple[tuple[str, str], ...] = ()  # (node, version) running another one


def _kube_binaries(out: TextIO) -> tuple[Binaries, Path]:
    """The control plane's binaries and the folder of kubelet and crisim, built into the cache
    first if missing (many minutes, once)."""
    out.write("Finding the Kubernetes binaries (the first time they are built from source: 15-25 min)\n")
    out.flush()
    try:
        return ensure_binaries(), ensure_node_binaries()
    except BuildError as exc:
        raise CommandError(f"the Kubernetes binaries could not be built:\n{exc}") from None


def _address_in_use(host: str, port: int) -> str:
    """Why `host:port` cannot be bound (empty when it can): the node agents' health servers need it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return ""


def _wipe_previous_run(layout: StateLayout) -> None:
    """Remove what a previous (stopped) run left, except the lock file we hold."""
    for entry in layout.root.iterdir():
        if entry == layout.lock_file:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def up(layout: StateLayout, options: UpOptions, out: TextIO) -> None:
    try:
        cluster = ClusterDescription(
            racks=options.racks,
            trays_per_rack=options.trays,
            partitions_per_rack=options.partitions_per_rack,
            address_block=options.address_block,
            driver_version=options.driver_version or SIMULATED_DRIVER_VERSION,
            node_driver_versions=options.node_driver_versions,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    names = list(cluster.node_names())
    longest = layout.longest_socket_path(names)
    if longest is not None and len(str(longest)) > MAX_UNIX_SOCKET_PATH:
        raise CommandError(
            f"state dir {layout.root} is too long: unix socket {longest} would exceed "
            f"{MAX_UNIX_SOCKET_PATH} bytes; choose a shorter --state-dir"
        )
    if options.kubernetes:
        try:
            check_inotify_budget(cluster.node_count)
        except InotifyBudgetExceeded as exc:
            raise CommandError(f"cannot run {cluster.node_count} nodes with Kubernetes: {exc}") from None
    binaries, node_bin_dir = _kube_binaries(out) if options.kubernetes else (None, None)
    lock_fd = try_lock(layout)
    if lock_fd is None:
        state = RunState.load(layout)
        pid = f" (supervisor pid {state.supervisor_pid})" if state else ""
        raise CommandError(
            f"cdsim is already running in {layout.root}{pid}; nothing was changed. "
            f"Use `cdsim status` to see it or `cdsim down` to stop it first."
        )
    try:
        stray = proc_scan.cluster_processes(layout)
        if stray:
            raise CommandError(
                f"processes of an earlier run in {layout.root} still run (pids "
                f"{', '.join(str(p.pid) for p in stray[:10])}); run `cdsim down` first"
            )
        busy = _address_in_use(cluster.node_at(0).address, AGENT_HEALTH_PORT)
        if busy:
            raise CommandError(
                f"{cluster.node_at(0).address}:{AGENT_HEALTH_PORT} is in use ({busy}): another simulated "
                f"cluster uses address block {options.address_block}; stop it or pass another --address-block"
            )
        _wipe_previous_run(layout)
        layout.logs_dir.mkdir(parents=True)
        cluster.save(layout.cluster_file)
        if options.secure:
            credentials.create(layout.pki_dir)
        for name in names:
            prepare_node_dirs(cluster, name, layout.nodes_dir)
            dirs = layout.node(name)
            for path in (dirs.kubelet_dir, dirs.cdi_root, dirs.imex_dir):
                path.mkdir(parents=True, exist_ok=True)
        SimConfig(
            racks=options.racks,
            trays_per_rack=options.trays,
            partitions_per_rack=options.partitions_per_rack,
            log_level=options.log_level,
            mesh=options.mesh,
            mesh_certificate_validity_s=options.mesh_certificate_validity_s,
            secure=options.secure,
            kubernetes=binaries is not None,
            kube_bin_dir=str(binaries.bin_dir) if binaries else "",
            kube_etcd=str(binaries.etcd) if binaries else "",
            kube_node_bin_dir=str(node_bin_dir or ""),
        ).save(layout)
        # The supervisor and its fork server run in the state dir: make this code importable there.
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        with open(layout.log_file("supervisor"), "ab") as log_file:
            supervisor = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tools.cdsim.supervisor",
                    "--state-dir",
                    str(layout.root),
                    "--lock-fd",
                    str(lock_fd),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=str(layout.root),
                pass_fds=(lock_fd,),
                env={**os.environ, "PYTHONPATH": python_path},
                start_new_session=True,
            )
    finally:
        # The supervisor holds the lock from here on (same open file description).
        os.close(lock_fd)
    _wait_up(layout, supervisor, cluster, out, options.kubernetes)


def _wait_up(
    layout: StateLayout,
    supervisor: subprocess.Popen[bytes],
    cluster: ClusterDescription,
    out: TextIO,
    kubernetes: bool,
) -> None:
    began = time.monotonic()
    timeout_s = KUBE_UP_TIMEOUT_S if kubernetes else UP_TIMEOUT_S
    mode = "with Kubernetes " if kubernetes else ""
    out.write(
        f"Starting a simulated cluster {mode}of {cluster.racks} rack(s) x {cluster.trays_per_rack} trays "
        f"({cluster.node_count} nodes) in {layout.root}\n"
    )
    out.flush()
    shown_etcd = False
    last_healthy = -1
    while True:
        if supervisor.poll() is not None:
            state = RunState.load(layout)
            if state is not None and state.phase == "stopped":
                raise CommandError(
                    f"stopped (cdsim down or SIGTERM) before it was up; logs in {layout.logs_dir}"
                )
            detail = state.error if state and state.error else _tail(layout, "supervisor")
            raise CommandError(f"the cluster failed to start:\n{detail}\n(logs in {layout.logs_dir})")
        state = RunState.load(layout)
        if state is not None:
            etcd = state.processes.get("etcd")
            if etcd and etcd.healthy and not shown_etcd:
                out.write(f"  etcd ready at {state.etcd_endpoint}\n")
                shown_etcd = True
            healthy = sum(1 for p in state.processes.values() if p.kind != "etcd" and p.healthy)
            total = sum(1 for p in state.processes.values() if p.kind != "etcd")
            if healthy != last_healthy and (
                healthy == total or healthy - last_healthy >= 8 or last_healthy < 0
            ):
                out.write(f"  services healthy: {healthy}/{total}\n")
                last_healthy = healthy
            out.flush()
            if state.phase == "ready":
                controllers = sum(1 for p in state.processes.values() if p.kind == "controller")
                out.write(
                    f"Cluster up in {time.monotonic() - began:.1f}s: etcd {state.etcd_endpoint}, "
                    f"placement advisor {state.advisor_endpoint}, {controllers} controller replicas, "
                    f"{cluster.node_count} node agents. Logs: {layout.logs_dir}\n"
                )
                out.write(
                    f"Secured: etcd with TLS and auth, the advisor with mutual TLS; certificates in {state.tls_dir}\n"
                    if state.tls_dir
                    else "Plaintext (--plaintext): etcd without TLS or auth, the advisor without TLS\n"
                )
                if state.kubeconfig:
                    out.write(
                        f"Kubernetes: {cluster.node_count} Nodes Ready (a real kubelet each, on the simulated "
                        f"container runtime), scheduler with the "
                        f"placement extender; control-plane logs in {layout.kube_dir / 'logs'}\n"
                        f"export KUBECONFIG={state.kubeconfig} PATH={state.kube_bin_dir}:$PATH\n"
                    )
                return
        if time.monotonic() - began > timeout_s:
            supervisor.terminate()
            raise CommandError(
                f"the cluster did not come up within {timeout_s:.0f}s (logs in {layout.logs_dir})"
            )
        time.sleep(0.1)


def _tail(layout: StateLayout, process: str, lines: int = 20) -> str:
    try:
        return "\n".join(layout.log_file(process).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _remove_leftover_node_ips(layout: StateLayout) -> list[str]:
    """The kubelets' node IPs of a Kubernetes-mode run whose supervisor was killed before it could
    remove them (tools/sim/kubelet/addresses.py)."""
    config = SimConfig.load(layout) if (layout.root / CONFIG_FILE_NAME).exists() else None
    if config is None or not config.kubernetes or not layout.cluster_file.exists():
        return []
    cluster = ClusterDescription.load(layout.cluster_file)
    try:
        return remove_leftovers(node_ip(cluster.address_block, i) for i in range(cluster.node_count))
    except NodeAddressError as exc:
        raise CommandError(f"could not remove the kubelets' node IPs: {exc}") from None


def down(layout: StateLayout, out: TextIO) -> None:
    state = RunState.load(layout)
    if supervisor_running(layout):
        try:
            control.request(layout, "shutdown", timeout_s=10.0)
        except control.ControlError:
            # A supervisor that does not answer is stopped by signal.
            if state is not None and pid_alive(state.supervisor_pid):
                os.kill(state.supervisor_pid, 15)
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        while supervisor_running(layout) and time.monotonic() < deadline:
            time.sleep(0.1)
        if supervisor_running(layout):
            if state is not None and pid_alive(state.supervisor_pid):
                os.kill(state.supervisor_pid, 9)
            time.sleep(0.2)
        stopped = True
    else:
        stopped = False
    leftovers = proc_scan.cluster_processes(layout)
    if leftovers:
        proc_scan.kill_all(leftovers)
        out.write(f"killed {len(leftovers)} leftover process(es) of {layout.root}\n")
    removed = _remove_leftover_node_ips(layout)
    if removed:
        out.write(f"removed {len(removed)} leftover kubelet node IP(s) of {layout.root}\n")
    if stopped:
        out.write(f"Cluster in {layout.root} stopped; nothing of it runs any more.\n")
    else:
        out.write(f"No cdsim cluster is running in {layout.root}; nothing to stop.\n")
