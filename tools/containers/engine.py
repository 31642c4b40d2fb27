"""A private docker engine for the container tests and `make image-smoke`.

Debian's dockerd (tools/containers/install.sh) started in a network namespace and a mount namespace
of its own, with everything it keeps under one directory the caller owns: its data root, exec root,
pidfile, socket, the containerd it manages (state and root), the docker client's config. So:

- the host's network is untouched: the bridges, veths and routes of its networks live in the
  engine's network namespace, whose only other interface is its own loopback. No route leads out
  of it, so containers reach each other and nothing else (and `--iptables=false --ip-masq=false
  --ip-forward=false --bridge=none`: no rules, no NAT, no default bridge even there);
- the host's mounts are untouched: the namespace's mounts are private, /run is a tmpfs of its own
  (containerd puts shim sockets under a fixed /run path), and every mount goes when the last
  process in the namespace exits;
- the containers' cgroups are under a parent named for this engine, so what the containers use
  is read in one place and the parent is removed at the end.

A port a container publishes on 127.0.0.1 is on the engine namespace's loopback: `in_netns` runs
a command there. Only processes this engine started are ever signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DOCKER_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Runs as the namespace's first process, then becomes dockerd: the loopback up (published ports
# bind it), a private /run.
_NAMESPACE_SETUP = 'ip link set lo up && mount -t tmpfs -o mode=0755 cd-engine-run /run && exec "$@"'


class EngineError(RuntimeError):
    """The engine could not start or a docker command failed; the message names it."""


def missing_tools() -> list[str]:
    return [
        tool
        for tool in ("dockerd", "containerd", "runc", "docker", "unshare", "ip")
        if not shutil.which(tool)
    ]


def mount_points_under(root: Path) -> list[str]:
    """Mount points at or below `root` in this process's mount namespace."""
    prefix = str(root)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points


def namespace_members(mnt_ns: str) -> list[int]:
    """Pids whose mount namespace is `mnt_ns` (as /proc/<pid>/ns/mnt reads)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "mnt") == mnt_ns:
                    pids.append(int(entry.name))
    return pids


@dataclass
class Engine:
    """One private dockerd rooted at `root` (a short path: its sockets live under it)."""

    root: Path
    plugin_dirs: list[Path] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    process: subprocess.Popen[bytes] | None = None
    mnt_ns: str = ""

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def log_file(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def cgroup_parent(self) -> str:
        return f"cd-engine-{self.tag}"

    def env(self) -> dict[str, str]:
        """The environment in which `docker` (and `docker compose`) talk to this engine only."""
        return {
            **os.environ,
            "DOCKER_HOST": f"unix://{self.socket}",
            "DOCKER_CONFIG": str(self.config_dir),
            "COMPOSE_ANSI": "never",
            "COMPOSE_STATUS_STDOUT": "1",
        }

    def dockerd_argv(self) -> list[str]:
        return [
            "dockerd",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.root / 'dockerd.pid'}",
            f"--host=unix://{self.socket}",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            "--bridge=none",
            f"--cgroup-parent=/{self.cgroup_parent}",
            # 0 leaves every score as it is: this machine refuses to lower one.
            "--oom-score-adjust=0",
            "--log-level=warn",
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        absent = missing_tools()
        if absent:
            raise EngineError(f"not installed: {', '.join(absent)} (run `make setup-containers`)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_dir.mkdir(exist_ok=True)
        config = {"cliPluginsExtraDirs": [str(p) for p in self.plugin_dirs]}
        (self.config_dir / "config.json").write_text(json.dumps(config))
        argv = ["unshare", "--net", "--mount", "--propagation", "private", "--"]
        argv += ["sh", "-c", _NAMESPACE_SETUP, "cd-engine", *self.dockerd_argv()]
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        log.info("engine_starting", root=str(self.root), pid=self.process.pid)
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.process.poll() is not None:
                raise EngineError(f"dockerd exited with code {self.process.returncode}:\n{self.log_tail()}")
            if not self.mnt_ns:
                with contextlib.suppress(OSError):
                    ns = os.readlink(f"/proc/{self.process.pid}/ns/mnt")
                    if ns != os.readlink("/proc/self/ns/mnt"):
                        self.mnt_ns = ns
            if self.mnt_ns and self.socket.exists() and self.ping():
                log.info("engine_ready", root=str(self.root), seconds=round(time.monotonic() - began, 1))
                return
            time.sleep(0.2)
        raise EngineError(
            f"dockerd did not answer on {self.socket} within {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def ping(self) -> bool:
        try:
            proc = subprocess.run(
                ["docker", "version", "--format", "{{.Server.Version}}"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=10.0,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and bool(proc.stdout.strip())

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def run(
        self, *args: str, timeout_s: float = DOCKER_TIMEOUT_S, cwd: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`docker ARGS` against this engine."""
        try:
            proc = subprocess.run(
                ["docker", *args],
                env=self.env(),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"docker {' '.join(args)} did not finish within {timeout_s:.0f} s") from exc
        if check and proc.returncode != 0:
            raise EngineError(
                f"docker {' '.join(args)} failed with exit code {proc.returncode}:\n"
                f"{(proc.stderr + proc.stdout).strip()}"
            )
        return proc

    def netns_argv(self, argv: list[str]) -> list[str]:
        """`argv` to be run in the engine's network namespace (where its published ports are)."""
        if self.process is None:
            raise EngineError("the engine is not running")
        return ["nsenter", f"--net=/proc/{self.process.pid}/ns/net", "--", *argv]

    def in_netns(self, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.netns_argv(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def containers_memory_bytes(self) -> int:
        """Resident memory (RSS) of every container of this engine, from their cgroups' parent."""
        stat = CGROUP_ROOT / "memory" / self.cgroup_parent / "memory.stat"
        for line in stat.read_text().splitlines():
            key, value = line.split()
            if key == "total_rss":
                return int(value)
        raise EngineError(f"no total_rss in {stat}")

    def daemon_rss_bytes(self) -> int:
        """RSS of the engine's own processes: dockerd, containerd and the containers' shims."""
        total = 0
        for pid in namespace_members(self.mnt_ns) if self.mnt_ns else []:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[str]:
        """Stop dockerd (it stops its containers and containerd), then check that nothing is left:
        no process in the namespace, no mount under the root, no cgroup; remove the root.

        Returns what had to be forced, as problems (empty when everything ended by itself)."""
        problems: list[str] = []
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                problems.append(f"dockerd did not exit within {grace_s:.0f} s of SIGTERM and was killed")
                self.process.kill()
                self.process.wait(timeout=10.0)
        if self.mnt_ns:
            deadline = time.monotonic() + 10.0
            while namespace_members(self.mnt_ns) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = namespace_members(self.mnt_ns)
            if left:
                problems.append(f"processes outlived dockerd and were killed: {left}")
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        problems += self._remove_cgroups()
        mounts = mount_points_under(self.root)
        if mounts:
            problems.append(f"mounts left under the engine's root (unmounted now): {mounts}")
            for point in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        log.info("engine_stopped", root=str(self.root), problems=problems)
        return problems

    def _remove_cgroups(self) -> list[str]:
        return remove_cgroup_tree(self.cgroup_parent)


def remove_cgroup_tree(parent_name: str) -> list[str]:
    """Remove the (empty) cgroup `parent_name` below the root of every hierarchy, with its
    children; returns the ones that could not be removed, as problems."""
    problems = []
    for parent in CGROUP_ROOT.glob(f"*/{parent_name}"):
        for directory in sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        try:
            parent.rmdir()
        except OSError as exc:
            problems.append(f"cgroup {parent} could not be removed: {exc}")
    return problems
