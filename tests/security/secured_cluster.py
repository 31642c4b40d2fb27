"""A small simulated cluster whose services reach etcd only over TLS, with a client certificate and
a password: etcd (client-cert auth, then etcd authentication with a least-privilege user), two
controller replicas, the placement advisor and per node an IMEX agent and a kubelet plugin, each a
real process with its own log and each component with its own client certificate.

The services are started from `tools.cdsim.services` specs (the same flags cdsim uses) plus the
etcd TLS and auth settings, under umask 0 so that nothing they create is protected by accident.
The password reaches one controller as a flag and everything else through the environment, the
way a Kubernetes Secret would.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aetcd import rpc

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools import launch
from tools.cdsim import proc_scan
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import SimConfig
from tools.cdsim.services import Ports, ServiceSpec, all_specs
from tools.controlplane.pki import CertKeyPair, generate_pki, issue_from_ca
from tools.etcd.server import EtcdServer
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/cd/v1/"
SERVICE_USER = "computedomains"
HEALTH_TIMEOUT_S = 90.0
# Each component's client certificate (its identity towards etcd; CN = the name), by spec kind.
CLIENT_OF_KIND = {
    "agent": "cd-node-agent",
    "imex-agent": "cd-imex-agent",
    "controller": "cd-controller",
    "advisor": "cd-placement-advisor",
}


def _prefix_end(prefix: str) -> bytes:
    data = bytearray(prefix.encode())
    data[-1] += 1
    return bytes(data)


@dataclass
class SecuredCluster:
    root: Path
    layout: StateLayout
    cluster: ClusterDescription
    etcd: EtcdServer
    ca: CertKeyPair
    clients: dict[str, CertKeyPair]
    password: str = field(repr=False)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    specs: dict[str, ServiceSpec] = field(default_factory=dict)
    # How each process was started (client cert, password, as flag), to start it again.
    _how: dict[str, tuple[str, str | None, bool]] = field(default_factory=dict, repr=False)
    # Processes that exited during start and were started again, as a supervisor would.
    restarts: list[str] = field(default_factory=list)
    advisor_endpoint: str = ""

    def store_config(self, client: str = "admin") -> EtcdConfig:
        pair = self.clients[client]
        return EtcdConfig(
            endpoint=self.etcd.endpoint,
            prefix=PREFIX,
            ca_file=str(self.ca.cert),
            cert_file=str(pair.cert),
            key_file=str(pair.key),
            username=SERVICE_USER,
            password=self.password,
            timeout_s=5.0,
        )

    def log_file(self, name: str) -> Path:
        return self.layout.log_file(name)

    def service_logs(self) -> dict[str, str]:
        """Every service's log (not etcd's: that is etcd's own business)."""
        return {
            path.stem: path.read_text(errors="replace") for path in sorted(self.layout.logs_dir.glob("*.log"))
        }

    def private_key_files(self) -> list[Path]:
        return sorted(self.root.glob("pki/*.key"))

    # ---- processes ---------------------------------------------------------------------------

    def _tls_flags(self, client: str) -> list[str]:
        pair = self.clients[client]
        return [
            "--etcd-ca-file", str(self.ca.cert),
            "--etcd-cert-file", str(pair.cert),
            "--etcd-key-file", str(pair.key),
        ]  # fmt: skip

    def start(
        self, spec: ServiceSpec, client: str, password: str | None = None, password_as_flag: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start one service process (module `spec.target`) with TLS and credentials."""
        module = spec.target.split(":")[0]
        env_prefix = "CD_ADVISOR_" if spec.kind == "advisor" else "CD_"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CD_")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        env[f"{env_prefix}ETCD_USERNAME"] = SERVICE_USER
        argv = [sys.executable, "-m", module, *spec.argv, *self._tls_flags(client)]
        if spec.kind == "imex-agent":
            # The test's end leaves no daemon behind (on a node they outlive the agent).
            argv += ["--stop-daemons-on-exit", "true"]
        secret = self.password if password is None else password
        if password_as_flag:
            argv += ["--etcd-password", secret]
        else:
            env[f"{env_prefix}ETCD_PASSWORD"] = secret
        with open(self.log_file(spec.name), "ab") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=env,
                umask=0,
                start_new_session=True,
            )
        self.processes[spec.name] = process
        self.specs[spec.name] = spec
        self._how[spec.name] = (client, password, password_as_flag)
        return process

    def wait_healthy(
        self, names: list[str], timeout_s: float = HEALTH_TIMEOUT_S, max_restarts: int = 3
    ) -> None:
        """Wait for /healthz of every named process; one that exits is started again (as a
        DaemonSet would), up to `max_restarts` times per process, and noted in `restarts`."""
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        while pending:
            for name in list(pending):
                process = self.processes[name]
                if process.poll() is not None:
                    exits = self.restarts.count(name)
                    if exits >= max_restarts:
                        raise RuntimeError(f"{name} exited ({process.returncode}):\n{self.tail(name)}")
                    self.restarts.append(name)
                    time.sleep(1.0)  # a restart delay, as kubelet's back-off would give
                    client, password, as_flag = self._how[name]
                    self.start(self.specs[name], client, password, as_flag)
                    continue
                if launch.http_ok(self.specs[name].health_url, timeout_s=1.0):
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy within {timeout_s}s: {pending}\n{self.tail(pending[0])}")
            if pending:
                time.sleep(0.2)

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        process = self.processes[name]
        launch.stop_process(process, grace_s)
        return process.returncode

    def stop_all(self) -> None:
        # Plugins, then IMEX agents (they stop their IMEX daemons), then the control plane.
        order = {"agent": 0, "imex-agent": 1}
        for name in sorted(self.processes, key=lambda n: order.get(self.specs[n].kind, 2)):
            self.stop(name)


async def enable_etcd_auth(config: EtcdConfig, password: str) -> None:
    """A root user (random password, never used again) and a service user confined to PREFIX."""
    async with Store(config) as store:
        auth = rpc.AuthStub(store.client.channel)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=secrets.token_hex(16)), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name=SERVICE_USER), timeout=5)
        permission = rpc.Permission(
            permType=rpc.Permission.READWRITE, key=PREFIX.encode(), range_end=_prefix_end(PREFIX)
        )
        await auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(name=SERVICE_USER, perm=permission), timeout=5
        )
        await auth.UserAdd(rpc.AuthUserAddRequest(name=SERVICE_USER, password=password), timeout=5)
        await auth.UserGrantRole(
            rpc.AuthUserGrantRoleRequest(user=SERVICE_USER, role=SERVICE_USER), timeout=5
        )
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


def create(trays: int, address_block: int, etcd_bin: Path) -> SecuredCluster:
    """PKI, etcd with TLS client-cert auth, the node directories; no service started yet."""
    # Short: the nodes' unix socket paths must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="cdsec-"))
    pki_dir = root / "pki"
    pki = generate_pki(pki_dir, service_ip="10.0.0.1")
    serving = issue_from_ca(pki.ca, pki_dir, "etcd", "etcd", ip_addresses=("127.0.0.1",), server=True)
    clients = {"admin": pki.admin}
    for name in CLIENT_OF_KIND.values():
        clients[name] = issue_from_ca(pki.ca, pki_dir, name, name)
    etcd = EtcdServer(
        data_dir=root / "etcd",
        binary=etcd_bin,
        cert_file=serving.cert,
        key_file=serving.key,
        trusted_ca_file=pki.ca.cert,
        client_cert_auth=True,
        log_path=root / "etcd.log",
    )
    layout = StateLayout.at(root)
    cluster = ClusterDescription(racks=1, trays_per_rack=trays, address_block=address_block)
    layout.logs_dir.mkdir(parents=True)
    cluster.save(layout.cluster_file)
    for name in cluster.node_names():
        prepare_node_dirs(cluster, name, layout.nodes_dir)
        for path in (layout.node(name).kubelet_dir, layout.node(name).cdi_root, layout.node(name).imex_dir):
            path.mkdir(parents=True, exist_ok=True)
    return SecuredCluster(
        root, layout, cluster, etcd, pki.ca, clients, password="pw-" + secrets.token_hex(12)
    )


def service_specs(cluster: SecuredCluster) -> list[ServiceSpec]:
    ports = Ports(
        etcd=cluster.etcd.client_port,
        advisor_grpc=free_port(),
        advisor_health=free_port(),
        controller_health=(free_port(), free_port()),
    )
    cluster.advisor_endpoint = f"127.0.0.1:{ports.advisor_grpc}"
    config = SimConfig(racks=1, trays_per_rack=cluster.cluster.trays_per_rack, log_level="debug")
    return all_specs(cluster.cluster, cluster.layout, config, ports)


def destroy(cluster: SecuredCluster) -> None:
    with contextlib.suppress(Exception):
        cluster.stop_all()
    # A daemon whose IMEX agent was killed before it could stop it would hold its port.
    proc_scan.kill_all(proc_scan.imex_daemons_under(cluster.root))
    cluster.etcd.destroy()
    shutil.rmtree(cluster.root, ignore_errors=True)
