"""A real Kubernetes control plane on loopback, for tests and manual use.

Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler as
child processes (like controller-runtime's envtest, plus the controller manager
and scheduler), waits until each is healthy and writes an admin kubeconfig.
There is no kubelet: tests create Node objects themselves, the real scheduler
binds pods to them and allocates DRA devices from the ResourceSlices present.

Manual use:  python -m tools.controlplane.cluster up --dir DIR [--kubernetes 1.32]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import structlog
import yaml

from tools.controlplane.binaries import Binaries, ensure_binaries
from tools.controlplane.pki import (
    FRONT_PROXY_CLIENT,
    CertKeyPair,
    ControlPlanePKI,
    generate_pki,
    issue_from_ca,
)
from tools.net_ports import free_ports

log = structlog.get_logger(__name__)

SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # first IP of SERVICE_CIDR: the `kubernetes` Service

# Without kubelets nobody renews node leases, so the node lifecycle controller
# would mark every test Node unreachable and taint it after ~50 s. With it off
# (and the TaintNodesByCondition admission plugin off), a Node a test creates
# is schedulable once its status has allocatable resources; taints and
# conditions change only when a test changes them. Tests that want the
# controller can pass their own list.
DEFAULT_CONTROLLERS = "*,-node-lifecycle-controller"

OLDEST_MINOR = 32
# The first supported release that serves scheduling.k8s.io/v1beta1 (Workload, PodGroup) behind
# the gates below; 1.32 knows none of them and refuses an unknown gate.
WORKLOAD_SCHEDULING_MINOR = 37
WORKLOAD_SCHEDULING_GATES = ("GenericWorkload", "TopologyAwareWorkloadScheduling")
# Opt-in only: with it, the job controller gives every Job (not only those with spec.scheduling)
# a Workload and a PodGroup, which changes how every other test's Jobs are scheduled.
WORKLOAD_WITH_JOB_GATE = "WorkloadWithJob"

_STOP_GRACE_S = 10.0
_PROBE_TIMEOUT_S = 2.0
_LOG_TAIL_LINES = 40


class ControlPlaneError(RuntimeError):
    """A control-plane process failed to start or to become healthy."""


def dra_args(minor: int) -> tuple[list[str], list[str]]:
    """(kube-apiserver args, args of every component) that turn DRA on for Kubernetes 1.<minor>.

    GA and on by default since 1.34 (stated anyway, so a reader sees DRA is relied upon). On 1.32
    and 1.33 it is beta and off: the apiserver, controller manager (resource claim controller) and
    scheduler (DynamicResources plugin) each need the gate, and the apiserver the beta API(s).
    """
    if minor >= 34:
        return ["--runtime-config=resource.k8s.io/v1=true"], []
    gate = ["--feature-gates=DynamicResourceAllocation=true"]
    if minor == 33:
        return ["--runtime-config=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true", *gate], gate
    if minor == OLDEST_MINOR:
        return ["--runtime-config=resource.k8s.io/v1beta1=true", *gate], gate
    raise ControlPlaneError(f"Kubernetes 1.{minor} is older than the oldest supported, 1.{OLDEST_MINOR}")


def workload_scheduling_args(minor: int, with_job: bool = False) -> tuple[list[str], list[str]]:
    """(kube-apiserver args, args of every component) that turn on kube-scheduler's gang and
    topology-aware scheduling: pods joined to a PodGroup by `spec.schedulingGroup.podGroupName`
    (and, `with_job`, Jobs with `spec.scheduling`). Off by default upstream (beta and alpha): the
    apiserver must serve the API and all three components must know the gates. Nothing below
    1.37 (a gate 1.32 does not know stops it from starting)."""
    if minor < WORKLOAD_SCHEDULING_MINOR:
        return [], []
    names = [*WORKLOAD_SCHEDULING_GATES, *([WORKLOAD_WITH_JOB_GATE] if with_job else [])]
    gates = ["--feature-gates=" + ",".join(f"{g}=true" for g in names)]
    return ["--runtime-config=scheduling.k8s.io/v1beta1=true", *gates], gates


def merge_flags(
    args: Sequence[str], names: Sequence[str] = ("--runtime-config", "--feature-gates")
) -> list[str]:
    """`args` with each of the comma-list flags `names` given once (values joined, first place kept)."""
    merged: list[str] = []
    where: dict[str, int] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        if sep and name in names:
            if name in where:
                merged[where[name]] += "," + value
                continue
            where[name] = len(merged)
        merged.append(arg)
    return merged


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


def die_with_parent() -> None:
    """Runs in the child before exec: if the test process dies, take the child with it."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kubeconfig(server: str, ca_pem: bytes, user: str, client: CertKeyPair) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "computedomains-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert_pem()),
                    "client-key-data": _b64(client.key_pem()),
                },
            }
        ],
        "contexts": [{"name": user, "context": {"cluster": "computedomains-test", "user": user}}],
        "current-context": user,
    }


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Synchronous on purpose: it is driven from session-scoped pytest fixtures and
    a CLI, and tests talk to it only over HTTPS. Use as a context manager or call
    start()/stop(). After start(): `server`, `kubeconfig`, `bin_dir` are set.

    start() returns once the controllers run (the default ServiceAccount exists);
    pass wait_for_controllers=False when `controllers` leaves out the
    serviceaccount controller.

    On 1.37 and later it serves kube-scheduler's gang and topology-aware scheduling
    (workload_scheduling_args); workload_with_job adds Jobs' spec.scheduling.
    """

    def __init__(
        self,
        binaries: Binaries,
        work_dir: Path,
        *,
        scheduler_config: Path | None = None,
        controllers: str = DEFAULT_CONTROLLERS,
        apiserver_args: Sequence[str] = (),
        controller_manager_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        startup_timeout_s: float = 60.0,
        wait_for_controllers: bool = True,
        workload_with_job: bool = False,
    ) -> None:
        self.binaries = binaries
        self.bin_dir = binaries.bin_dir
        self.work_dir = work_dir.resolve()
        self.log_dir = self.work_dir / "logs"
        self.pki_dir = self.work_dir / "pki"
        self.kubeconfig = self.work_dir / "admin.kubeconfig"
        self.controller_manager_kubeconfig = self.work_dir / "kube-controller-manager.kubeconfig"
        self.scheduler_kubeconfig = self.work_dir / "kube-scheduler.kubeconfig"
        self.default_scheduler_config_path = self.work_dir / "kube-scheduler.yaml"
        self._scheduler_config = scheduler_config
        self._controllers = controllers
        self._apiserver_args = list(apiserver_args)
        self._kcm_args = list(controller_manager_args)
        self._scheduler_args = list(scheduler_args)
        self._startup_timeout_s = startup_timeout_s
        self._wait_for_controllers = wait_for_controllers
        dra_apiserver, dra_components = dra_args(binaries.minor)
        workload_apiserver, workload_components = workload_scheduling_args(binaries.minor, workload_with_job)
        self._feature_apiserver_args = merge_flags([*dra_apiserver, *workload_apiserver])
        self._feature_component_args = merge_flags([*dra_components, *workload_components])
        self._procs: dict[str, _Process] = {}
        self._pki: ControlPlanePKI | None = None
        self.etcd_url = ""
        self.server = ""
        self._kcm_port = 0
        self._scheduler_port = 0

    # ----------------------------------------------------------------- public

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def ca_file(self) -> Path:
        return self._require_pki().ca.cert

    def log_path(self, name: str) -> Path:
        """Log file of one process: etcd, kube-apiserver, kube-controller-manager, kube-scheduler."""
        return self.log_dir / f"{name}.log"

    @property
    def version(self) -> str:
        """The Kubernetes release of the binaries, e.g. v1.37.2 ("" when not known)."""
        return self.binaries.version

    def start(self) -> None:
        """Start all processes and return once every one is healthy (or raise ControlPlaneError)."""
        if self._procs:
            raise ControlPlaneError("control plane already started")
        started = time.monotonic()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        etcd_client, etcd_peer, apiserver, kcm, scheduler = free_ports(5)
        self.etcd_url = f"http://127.0.0.1:{etcd_client}"
        self.server = f"https://127.0.0.1:{apiserver}"
        self._kcm_port, self._scheduler_port = kcm, scheduler
        pki = self._pki = generate_pki(self.pki_dir, SERVICE_IP)
        self._write_kubeconfigs(pki)
        deadline = time.monotonic() + self._startup_timeout_s
        try:
            self._spawn("etcd", self._etcd_cmd(etcd_client, etcd_peer))
            self._await("etcd", deadline, self._etcd_healthy)
            self._spawn("kube-apiserver", self._apiserver_cmd(apiserver))
            self._await("kube-apiserver", deadline, self._apiserver_ready)
            self._spawn("kube-controller-manager", self._controller_manager_cmd())
            self._start_scheduler()
            self._await("kube-controller-manager", deadline, lambda: self._component_healthy(self._kcm_port))
            self._await("kube-scheduler", deadline, lambda: self._component_healthy(self._scheduler_port))
            if self._wait_for_controllers:
                self._await("kube-controller-manager", deadline, self._controllers_running)
        except BaseException:
            self.stop()
            raise
        log.info("control_plane_ready", server=self.server, seconds=round(time.monotonic() - started, 1))

    def stop(self) -> None:
        """SIGTERM every process (etcd last), SIGKILL what is still alive after a grace period."""
        components = [p for n, p in self._procs.items() if n != "etcd"]
        self._terminate(components)
        etcd = self._procs.get("etcd")
        if etcd is not None:
            self._terminate([etcd])
        self._procs.clear()

    def node_kubeconfig(self, node: str, directory: Path) -> Path:
        """A kubeconfig for the kubelet of `node` in `directory`: user system:node:<node> in group
        system:nodes, whom the Node authorizer and NodeRestriction admission confine to its node."""
        pki = self._require_pki()
        directory.mkdir(parents=True, exist_ok=True)
        user = f"system:node:{node}"
        pair = issue_from_ca(pki.ca, directory, "kubelet-client", user, organizations=("system:nodes",))
        path = directory / "kubelet.kubeconfig"
        path.write_text(yaml.safe_dump(_kubeconfig(self.server, pki.ca.cert_pem(), user, pair)))
        path.chmod(0o600)
        return path

    def restart_scheduler(self, config: Path | None = None) -> None:
        """Restart kube-scheduler with `config` (e.g. one adding an extender); None = the default config.

        A config file must carry `clientConnection.kubeconfig` (see scheduler_config()),
        since kube-scheduler ignores --kubeconfig when --config is given.
        """
        proc = self._procs.pop("kube-scheduler", None)
        if proc is not None:
            self._terminate([proc])
        self._scheduler_config = config
        self._start_scheduler()
        deadline = time.monotonic() + self._startup_timeout_s
        self._await("kube-scheduler", deadline, lambda: self._component_healthy(self._scheduler_port))

    def restart_apiserver(self, down_s: float = 0.0) -> None:
        """Stop kube-apiserver (SIGTERM, SIGKILL after the grace period), keep it down `down_s`,
        start it again on the same address and return once it is ready."""
        proc = self._procs.pop("kube-apiserver", None)
        if proc is not None:
            self._terminate([proc])
        time.sleep(down_s)
        self._spawn("kube-apiserver", self._apiserver_cmd(int(self.server.rsplit(":", 1)[1])))
        deadline = time.monotonic() + self._startup_timeout_s
        self._await("kube-apiserver", deadline, self._apiserver_ready)

    def scheduler_config(self, extenders: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The KubeSchedulerConfiguration used by default, with optional extenders added."""
        config: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.scheduler_kubeconfig)},
            "leaderElection": {"leaderElect": False},
        }
        if extenders:
            config["extenders"] = extenders
        return config

    def kubectl(
        self, *args: str, timeout_s: float = 60.0, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this control plane as admin."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            input=input,
            check=False,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    # --------------------------------------------------------------- commands

    def _etcd_cmd(self, client_port: int, peer_port: int) -> list[str]:
        peer = f"http://127.0.0.1:{peer_port}"
        return [
            str(self.binaries.etcd),
            "--name=default",
            f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            # Test data need not survive a power cut; fsync dominates etcd latency.
            "--unsafe-no-fsync=true",
        ]

    def _apiserver_cmd(self, port: int) -> list[str]:
        pki = self._require_pki()
        return [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.work_dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.apiserver_serving.cert}",
            f"--tls-private-key-file={pki.apiserver_serving.key}",
            f"--client-ca-file={pki.ca.cert}",
            # Request-header authentication lets the scheduler and controller manager
            # delegate authentication (and aggregated APIs work) as on a kubeadm cluster.
            f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
            f"--proxy-client-key-file={pki.front_proxy_client.key}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            # ServiceAccount: no kubelet mounts tokens here, and the plugin would reject pods
            # in a fresh namespace until the controller manager has created its default SA.
            # TaintNodesByCondition: it taints every new Node not-ready, and only the node
            # lifecycle controller (off, see DEFAULT_CONTROLLERS) would lift the taint.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            # The loopback advertise address cannot be an Endpoints address.
            "--endpoint-reconciler-type=none",
            *self._feature_apiserver_args,
            *self._apiserver_args,
        ]

    def _component_serving_args(self, name: str, port: int, kubeconfig: Path) -> list[str]:
        return [
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.work_dir / (name + '-certs')}",
        ]

    def _controller_manager_cmd(self) -> list[str]:
        pki = self._require_pki()
        kubeconfig = self.controller_manager_kubeconfig
        return [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            *self._component_serving_args("kube-controller-manager", self._kcm_port, kubeconfig),
            "--leader-elect=false",
            f"--controllers={self._controllers}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--cluster-signing-cert-file={pki.ca.cert}",
            f"--cluster-signing-key-file={pki.ca.key}",
            *self._feature_component_args,
            *self._kcm_args,
        ]

    def _start_scheduler(self) -> None:
        config = self._scheduler_config
        if config is None:
            self.default_scheduler_config_path.write_text(yaml.safe_dump(self.scheduler_config()))
            config = self.default_scheduler_config_path
        cmd = [
            str(self.bin_dir / "kube-scheduler"),
            f"--config={config}",
            *self._component_serving_args("kube-scheduler", self._scheduler_port, self.scheduler_kubeconfig),
            *self._feature_component_args,
            *self._scheduler_args,
        ]
        self._spawn("kube-scheduler", cmd)

    # -------------------------------------------------------------- plumbing

    def _require_pki(self) -> ControlPlanePKI:
        if self._pki is None:
            raise ControlPlaneError("control plane not started")
        return self._pki

    def _write_kubeconfigs(self, pki: ControlPlanePKI) -> None:
        ca_pem = pki.ca.cert_pem()
        for path, user, pair in (
            (self.kubeconfig, "admin", pki.admin),
            (self.controller_manager_kubeconfig, "system:kube-controller-manager", pki.controller_manager),
            (self.scheduler_kubeconfig, "system:kube-scheduler", pki.scheduler),
        ):
            path.write_text(yaml.safe_dump(_kubeconfig(self.server, ca_pem, user, pair)))
            path.chmod(0o600)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log_path = self.log_path(name)
        log_file = log_path.open("ab")
        log_file.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log_file.flush()
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self.work_dir,
            # Own session: a terminal Ctrl-C reaches us, and we stop the processes in order.
            start_new_session=True,
            preexec_fn=die_with_parent,  # only prctl: safe between fork and exec
        )
        self._procs[name] = _Process(name, popen, log_path, log_file)
        log.info("control_plane_process_started", process=name, pid=popen.pid, log=str(log_path))

    def _await(self, name: str, deadline: float, healthy: Callable[[], bool]) -> None:
        delay = 0.05
        while True:
            for proc in self._procs.values():
                code = proc.popen.poll()
                if code is not None:
                    raise ControlPlaneError(
                        f"{proc.name} exited with code {code} while waiting for {name}; "
                        f"last lines of {proc.log_path}:\n{_log_tail(proc.log_path)}"
                    )
            if healthy():
                return
            if time.monotonic() > deadline:
                proc = self._procs[name]
                raise ControlPlaneError(
                    f"{name} not healthy within {self._startup_timeout_s:.0f} s; "
                    f"last lines of {proc.log_path}:\n{_log_tail(proc.log_path)}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _etcd_healthy(self) -> bool:
        return self._get(f"{self.etcd_url}/health", None) is not None

    def _apiserver_ready(self) -> bool:
        return self._get(f"{self.server}/readyz", self._admin_context()) == b"ok"

    def _admin_context(self) -> ssl.SSLContext:
        pki = self._require_pki()
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        ctx.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
        return ctx

    def _controllers_running(self) -> bool:
        # The controller manager reports healthy seconds before its controllers run (each
        # first waits for its service-account token). The serviceaccount controller creates
        # default/default once the shared informers run, which all controllers (the
        # resource claim controller too) start together.
        url = f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"
        return self._get(url, self._admin_context()) is not None

    def _component_healthy(self, port: int) -> bool:
        # Their serving certificates are self-signed in --cert-dir; /healthz is open to anyone.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return self._get(f"https://127.0.0.1:{port}/healthz", ctx) == b"ok"

    @staticmethod
    def _get(url: str, ctx: ssl.SSLContext | None) -> bytes | None:
        try:
            with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT_S, context=ctx) as resp:
                body: bytes = resp.read()
                return body.strip() if resp.status == 200 else None
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return None

    @staticmethod
    def _terminate(procs: list[_Process]) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("control_plane_process_killed", process=proc.name, pid=proc.popen.pid)
                proc.popen.kill()
                proc.popen.wait(timeout=_STOP_GRACE_S)
            proc.log_file.close()


def _cmd_up(args: argparse.Namespace) -> int:
    binaries = ensure_binaries(minor=args.kubernetes or None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with ControlPlane(binaries, Path(args.dir)) as cp:
        print(f"server:     {cp.server}")
        print(f"kubeconfig: {cp.kubeconfig}")
        print(f"logs:       {cp.log_dir}")
        print(f"export KUBECONFIG={cp.kubeconfig} PATH={cp.bin_dir}:$PATH")
        print("Ctrl-C stops the control plane.", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.controlplane.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build if needed, start a control plane and keep it up until Ctrl-C")
    up.add_argument("--dir", required=True, help="work directory (certificates, etcd data, logs, kubeconfig)")
    up.add_argument(
        "--kubernetes", default="", metavar="MINOR", help="Kubernetes minor, e.g. 1.32 (default: the newest)"
    )
    up.set_defaults(func=_cmd_up)
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
