"""One simulated node on a real container runtime: containerd v2 (tools/containerd/build.sh, with
Debian's runc) under the upstream kubelet, instead of crisim.

Both run in one private mount namespace per node, held by a process of ours (the node's "host"):
kubelet's hard-coded host paths are the node's own as in tools.sim.kubelet.node, and /run is a tmpfs
of its own, because containerd's shims and the pods' network namespaces live under fixed paths
there. Kubelet stays in the host's network namespace (its node IP, the API server on loopback);
containerd, its shims and so the CNI bridge run in the environment's pod network namespace
(tools.containerd.network). Containers go into cgroups under a parent named for the node
(kubelet's cgroupRoot), which stop() removes.

stop() tears everything down and records what it had to force in `stop_problems`; `leftovers()`
says what is still there afterwards (it must be nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tools.containerd.config import ContainerdPaths, write_node_config
from tools.containerd.network import PodNetworkNamespace, end_process, wait_for_exec
from tools.containers.engine import CGROUP_ROOT, mount_points_under, namespace_members, remove_cgroup_tree
from tools.sim.kubelet.node import NAMESPACE_SETUP_ENV, KubeletNode, _Running

log = structlog.get_logger(__name__)

CRI_NAMESPACE = "k8s.io"  # containerd namespace of the CRI's images and containers
_RUN_TMPFS = "mount -t tmpfs -o mode=0755 cd-node-run /run && exec sleep infinity"
_CTR_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 60.0
_SHIM_EXIT_WAIT_S = 10.0
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RuntimeError_(RuntimeError):
    """containerd did not start or a ctr command failed; the message names it."""


@dataclass
class ContainerdKubeletNode(KubeletNode):
    """The kubelet and containerd of simulated node `name` (`ordinal`: its range of pod IPs)."""

    ordinal: int = 0
    containerd_bin: Path = Path("/nonexistent")
    network: PodNetworkNamespace | None = None
    sandbox_image: str = ""
    stop_problems: list[str] = field(default_factory=list)
    _holder: _Running | None = None
    _mnt_ns: str = ""
    _ended_ticks: int = 0  # when the holder ended, in clock ticks since boot

    @property
    def paths(self) -> ContainerdPaths:
        return ContainerdPaths(self.state_dir)

    @property
    def runtime_socket(self) -> Path:
        return self.paths.socket

    @property
    def runtime_log(self) -> Path:
        return self.log_dir / f"containerd-{self.name}.log"

    @property
    def cgroup_parent(self) -> str:
        """The pods' cgroup parent, one per node (a digest of its state dir: unique per run)."""
        return "cd-node-" + hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:10]

    @property
    def mount_namespace(self) -> str:
        """/proc/<holder>/ns/mnt, for `nsenter --mount=`."""
        if self._holder is None:
            raise RuntimeError_(f"the host namespace of {self.name} is not running")
        return f"/proc/{self._holder.popen.pid}/ns/mnt"

    def kubelet_config(self) -> dict[str, Any]:
        config = super().kubelet_config()
        # The containers are real: kubelet makes the pods' cgroups (QoS classes, one per pod) under
        # this node's parent. Without QoS cgroups kubelet gives the runtime no parent at all, and
        # containerd puts every container of every node under a shared /k8s.io.
        config["cgroupsPerQOS"] = True
        config["cgroupRoot"] = f"/{self.cgroup_parent}"
        return config

    def _make_cgroup_parent(self) -> None:
        """Kubelet requires its cgroupRoot to exist in every hierarchy."""
        for hierarchy in CGROUP_ROOT.iterdir():
            if (hierarchy / "cgroup.procs").exists():
                (hierarchy / self.cgroup_parent).mkdir(exist_ok=True)

    def start_runtime(self) -> None:
        if not (self.containerd_bin / "containerd").is_file():
            raise RuntimeError_(
                f"containerd is not built in {self.containerd_bin} (tools/containerd/build.sh)"
            )
        if self.network is None:
            raise RuntimeError_("a containerd node needs the environment's pod network namespace")
        self.make_host_dirs()
        self._make_cgroup_parent()
        write_node_config(
            self.paths, self.ordinal, self.cdi_root or self.state_dir / "cdi", self.sandbox_image
        )
        if self._holder is None:
            self._holder = self._spawn(
                self.log_dir / f"host-{self.name}.log",
                self.namespace_setup_argv(["sh", "-ec", _RUN_TMPFS]),
                env=NAMESPACE_SETUP_ENV,
            )
            wait_for_exec(self._holder.popen, "sleep", f"the host namespace of {self.name}")
            self._mnt_ns = os.readlink(self.mount_namespace)
        argv = ["nsenter", f"--mount={self.mount_namespace}", f"--net={self.network.path}", "--"]
        argv += [str(self.containerd_bin / "containerd"), "--config", str(self.paths.config)]
        # The shim containerd starts is the first containerd-shim-runc-v2 on PATH: ours.
        self._runtime = self._spawn(
            self.runtime_log, argv, env={"PATH": f"{self.containerd_bin}:{_SYSTEM_PATH}"}
        )
        began = time.monotonic()
        while time.monotonic() - began < _START_TIMEOUT_S:
            if self._runtime.popen.poll() is not None:
                raise RuntimeError_(f"containerd of {self.name} exited: see {self.runtime_log}")
            if self.runtime_socket.exists() and self.ctr("version", check=False).returncode == 0:
                log.info("containerd_ready", node=self.name, seconds=round(time.monotonic() - began, 1))
                return
            time.sleep(0.2)
        raise RuntimeError_(f"containerd of {self.name} did not answer within {_START_TIMEOUT_S:.0f} s")

    def kubelet_command(self) -> list[str]:
        return ["nsenter", f"--mount={self.mount_namespace}", "--", *self.kubelet_argv()]

    def ctr(
        self, *args: str, check: bool = True, timeout_s: float = _CTR_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """`ctr ARGS` against this node's containerd, in the CRI's namespace."""
        argv = [
            str(self.containerd_bin / "ctr"),
            "--address",
            str(self.runtime_socket),
            "--namespace",
            CRI_NAMESPACE,
        ]
        try:
            proc = subprocess.run(
                [*argv, *args],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError_(
                f"ctr {' '.join(args)} on {self.name} did not finish within {timeout_s:.0f} s"
            ) from exc
        if check and proc.returncode != 0:
            raise RuntimeError_(
                f"ctr {' '.join(args)} on {self.name} failed: {(proc.stderr or proc.stdout).strip()}"
            )
        return proc

    def import_image(self, archive: Path) -> None:
        """A docker-archive into this node's image store, under the name it carries."""
        self.ctr("images", "import", str(archive))

    def container_pids(self) -> list[int]:
        """Every process in this node's container cgroups."""
        pids: set[int] = set()
        for procs in (CGROUP_ROOT / "pids" / self.cgroup_parent).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
        return sorted(pids)

    def runtime_pids(self) -> list[int]:
        """containerd, its shims and the holder: the processes of the node's mount namespace."""
        return namespace_members(self._mnt_ns) if self._mnt_ns else []

    def stop(self) -> None:
        """Stop kubelet, remove every container, stop containerd and end the namespace; what had to
        be forced goes to `stop_problems`."""
        self.stop_kubelet()
        if self._runtime is not None and self._runtime.popen.poll() is None:
            for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                deleted = self.ctr("tasks", "delete", "--force", task, check=False)
                # "not found": containerd removed it meanwhile (its process had exited).
                if deleted.returncode != 0 and "not found" not in deleted.stderr:
                    self.stop_problems.append(
                        f"ctr tasks delete {task} failed: {deleted.stderr.strip()[-300:]}"
                    )
        if self._runtime is not None:
            if end_process(self._runtime.popen):
                self.stop_problems.append("containerd did not exit on SIGTERM and was killed")
            self._runtime.log_file.close()
            self._runtime = None
        holder = self._holder.popen.pid if self._holder else 0
        deadline = time.monotonic() + _SHIM_EXIT_WAIT_S
        while [p for p in self.runtime_pids() if p != holder] and time.monotonic() < deadline:
            time.sleep(0.2)
        self._kill(
            "shims that outlived containerd", _described([p for p in self.runtime_pids() if p != holder])
        )
        self._kill("container processes left after their tasks were deleted", self.container_pids())
        if self._holder is not None:
            end_process(self._holder.popen)
            self._holder.log_file.close()
            self._holder = None
            self._ended_ticks = _uptime_ticks()
        self.stop_problems += remove_cgroup_tree(self.cgroup_parent)
        if self.stop_problems:
            log.warning("node_stop_forced", node=self.name, problems=self.stop_problems)

    def _kill(self, what: str, pids: dict[int, str] | list[int]) -> None:
        if not pids:
            return
        self.stop_problems.append(f"{what} were killed: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)

    def leftovers(self) -> list[str]:
        """What of this node is still there after stop(): processes, cgroups, mounts on the host."""
        found = []
        # Once the namespace is gone the kernel may give its number to a new one (another
        # session's): only a process started before the holder ended can be in ours.
        left = [p for p in self.runtime_pids() if _start_ticks(p) <= self._ended_ticks]
        if left:
            found.append(f"processes in the node's mount namespace: {_described(left)}")
        cgroups = sorted(str(p) for p in CGROUP_ROOT.glob(f"*/{self.cgroup_parent}"))
        if cgroups:
            found.append(f"cgroups: {cgroups}")
        mounts = mount_points_under(self.state_dir)
        if mounts:
            found.append(f"mounts under the node's state dir: {mounts}")
        return found


def _described(pids: list[int]) -> dict[int, str]:
    """pid -> its command line (for a message)."""
    described = {}
    for pid in pids:
        try:
            described[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            described[pid] = "(gone)"
    return described


def _uptime_ticks() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 1 << 62  # gone: not a leftover
    return int(stat.rsplit(")", 1)[1].split()[19])
