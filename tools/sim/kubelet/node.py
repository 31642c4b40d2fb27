"""One simulated node: the upstream kubelet on crisim, the simulated container runtime.

Kubelet runs in a private mount namespace (util-linux `unshare --mount --propagation private`), in
which its hard-coded host paths are the node's own: /var/lib/kubelet (device-plugins) is its root
dir, /var/log (containers, pods) a folder of the node, and each /proc/sys value it sets at start a
private copy. Nothing it writes reaches the host; the namespace ends with the process. Its node IP
comes from tools.sim.kubelet.addresses, its ports are kubelet's usual ones on that IP.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog
import yaml

from tools.controlplane.cluster import die_with_parent
from tools.sim.kubelet.inotify import INSTANCES_PER_KUBELET

log = structlog.get_logger(__name__)

KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
# What kubelet's container manager sets under /proc/sys at start (vm.overcommit_memory=1 and the
# panic settings): inside its namespace each is a bind mount of a copy in the node's state dir.
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Runs as root in the new mount namespace, then becomes kubelet: $1 the node's state dir, $2
# kubelet's root dir, the rest kubelet's command line.
# Kubelet renews its Lease every quarter of this (upstream default: 40 s); short, so that the node
# lifecycle controller, given a grace period to match (NODE_MONITOR_GRACE_S), sees a stopped
# kubelet within seconds.
NODE_LEASE_DURATION_S = 8
NODE_MONITOR_GRACE_S = 16
_NAMESPACE_SETUP = r"""
state="$1"; root="$2"; shift 2
mount -t tmpfs -o mode=0755,size=1m cd-kubelet-var-lib /var/lib
mkdir /var/lib/kubelet
mount --bind "$root" /var/lib/kubelet
mount --bind "$state/var-log" /var/log
for tunable in $CD_KERNEL_TUNABLES; do
    copy="$state/proc-sys/$(printf %s "$tunable" | tr / .)"
    cat "/proc/sys/$tunable" > "$copy"
    mount --bind "$copy" "/proc/sys/$tunable"
done
exec "$@"
"""
NAMESPACE_SETUP_ENV = {"CD_KERNEL_TUNABLES": " ".join(KERNEL_TUNABLES)}
# Kubelet fails at start when the user has no inotify instance left (tools.sim.kubelet.inotify).
INOTIFY_EXHAUSTED = "inotify_init: too many open files"
_STOP_GRACE_S = 10.0
_PROBE_TIMEOUT_S = 1.0


def kubelet_configuration(ip: str, runtime_socket: Path, state_dir: Path, minor: int) -> dict[str, Any]:
    """The KubeletConfiguration of one simulated node."""
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": ip,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        # Nobody calls kubelet's API here (the API server has no kubelet client certificate), so
        # it authenticates no one: a client CA file would cost an inotify instance.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        # This machine's cgroups are v1 and it has no systemd; the runtime runs no process, so
        # kubelet needs no pod cgroups and reserves nothing.
        "failCgroupV1": False,
        "failSwapOn": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "protectKernelDefaults": False,
        # Kubelet creates its FlexVolume folder; keep it in the node's state dir.
        "volumePluginDir": str(state_dir / "volume-plugins"),
        "nodeLeaseDurationSeconds": NODE_LEASE_DURATION_S,
        "nodeStatusUpdateFrequency": "4s",
        # A pod whose claim kubelet could not prepare yet is retried at the next pod resync, not
        # with a backoff: right after binding, the Node authorizer may not yet link the claim to
        # the node ("no relationship found"), and at the default 1m every such pod waits ~65 s.
        "syncFrequency": "10s",
        "imageGCHighThresholdPercent": 100,
        "serializeImagePulls": False,
        "resolvConf": "",
        "clusterDomain": "cluster.local",
    }
    # The serving certificate is generated once and never changes: no file watch for it, which
    # saves an inotify instance per kubelet (tools.sim.kubelet.inotify).
    gates: dict[str, bool] = {"ReloadKubeletServerCertificateFile": False}
    if minor < 34:
        gates["DynamicResourceAllocation"] = True
    config["featureGates"] = gates
    return config


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT_S) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class _Running:
    popen: subprocess.Popen[bytes]
    log_file: IO[bytes]


@dataclass
class KubeletNode:
    """The kubelet and container runtime of simulated node `name`."""

    name: str
    ip: str
    kubelet_dir: Path  # kubelet's root dir: the kubelet plugin's --kubelet-dir
    state_dir: Path  # the runtime's socket and record, kubelet's config and namespace files
    bin_dir: Path  # kubelet and crisim
    kubeconfig: Path
    log_dir: Path
    minor: int
    labels: Mapping[str, str] = field(default_factory=dict)
    cdi_root: Path | None = None  # where the runtime resolves CDI devices (None: not checked)
    gpus: int = 0  # nvidia.com/gpu the runtime advertises through kubelet's device-plugin API
    verbosity: int = 2
    _kubelet: _Running | None = None
    _runtime: _Running | None = None

    @property
    def runtime_socket(self) -> Path:
        return self.state_dir / "crisim.sock"

    @property
    def _cwd(self) -> Path:
        """The processes' working directory, empty: anything they write by a relative path lands here."""
        return self.state_dir / "cwd"

    @property
    def record_path(self) -> Path:
        """crisim's record: one JSON object per RunPodSandbox, CreateContainer, container exit."""
        return self.state_dir / "cri-record.jsonl"

    @property
    def kubelet_log(self) -> Path:
        return self.log_dir / f"kubelet-{self.name}.log"

    @property
    def runtime_log(self) -> Path:
        return self.log_dir / f"crisim-{self.name}.log"

    @property
    def kubelet_pid(self) -> int:
        return self._kubelet.popen.pid if self._kubelet else 0

    def start(self) -> None:
        self.start_runtime()
        self.start_kubelet()

    def start_runtime(self) -> None:
        self._cwd.mkdir(parents=True, exist_ok=True)
        self._runtime = self._spawn(
            self.runtime_log,
            [
                str(self.bin_dir / "crisim"),
                f"--listen=unix://{self.runtime_socket}",
                f"--record={self.record_path}",
                *([f"--cdi-spec-dir={self.cdi_root}"] if self.cdi_root else []),
                *(
                    [f"--gpus={self.gpus}", f"--device-plugin-dir={self.kubelet_dir / 'device-plugins'}"]
                    if self.gpus
                    else []
                ),
            ],
        )

    def kubelet_config(self) -> dict[str, Any]:
        return kubelet_configuration(self.ip, self.runtime_socket, self.state_dir, self.minor)

    def kubelet_argv(self) -> list[str]:
        """Kubelet's own command line (its config file written)."""
        config_path = self.state_dir / "kubelet-config.yaml"
        config_path.write_text(yaml.safe_dump(self.kubelet_config()))
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        kubelet = [
            str(self.bin_dir / "kubelet"),
            f"--config={config_path}",
            f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.kubelet_dir}",
            f"--cert-dir={self.kubelet_dir / 'pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            f"--v={self.verbosity}",
        ]
        if labels:
            kubelet.append(f"--node-labels={labels}")
        return kubelet

    def namespace_setup_argv(self, command: list[str]) -> list[str]:
        """`command` run in a new private mount namespace set up as the node's host (see above)."""
        return [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-ec", _NAMESPACE_SETUP, "kubelet-namespace", str(self.state_dir), str(self.kubelet_dir),
            *command,
        ]  # fmt: skip

    def kubelet_command(self) -> list[str]:
        return self.namespace_setup_argv(self.kubelet_argv())

    def make_host_dirs(self) -> None:
        for d in (self.kubelet_dir, self.state_dir / "var-log", self.state_dir / "proc-sys", self._cwd):
            d.mkdir(parents=True, exist_ok=True)

    def start_kubelet(self) -> None:
        self.make_host_dirs()
        self._kubelet = self._spawn(self.kubelet_log, self.kubelet_command(), env=NAMESPACE_SETUP_ENV)

    def startup_problem(self) -> str:
        """A known reason why kubelet did not start, from its log ("" if none is recognised)."""
        try:
            log_text = self.kubelet_log.read_text(errors="replace")
        except OSError:
            return ""
        if INOTIFY_EXHAUSTED in log_text:
            return (
                f"kubelet of {self.name} found no free inotify instance: this user's processes hold "
                f"fs.inotify.max_user_instances of them (each kubelet takes {INSTANCES_PER_KUBELET})"
            )
        return ""

    def kubelet_healthy(self) -> bool:
        return _http_ok(f"http://{self.ip}:{KUBELET_HEALTHZ_PORT}/healthz")

    def kubelet_running(self) -> bool:
        return self._kubelet is not None and self._kubelet.popen.poll() is None

    def stop_kubelet(self, kill: bool = False) -> None:
        """Stop kubelet (SIGTERM, or SIGKILL when `kill`); its pods stay in the runtime."""
        self._end(self._kubelet, signal.SIGKILL if kill else signal.SIGTERM)
        self._kubelet = None

    def stop(self) -> None:
        self.stop_kubelet()
        self._end(self._runtime, signal.SIGTERM)
        self._runtime = None

    def _spawn(self, log_path: Path, cmd: list[str], env: Mapping[str, str] | None = None) -> _Running:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("ab")
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self._cwd,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,  # only prctl: safe between fork and exec
        )
        log.info("node_process_started", node=self.name, pid=popen.pid, log=str(log_path))
        return _Running(popen, log_file)

    @staticmethod
    def _end(running: _Running | None, sig: signal.Signals) -> None:
        if running is None:
            return
        with contextlib.suppress(ProcessLookupError):
            running.popen.send_signal(sig)
        try:
            running.popen.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            running.popen.kill()
            running.popen.wait(_STOP_GRACE_S)
        running.log_file.close()
