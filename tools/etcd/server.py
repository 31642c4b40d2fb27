"""Run a real etcd server as a subprocess (tests, `cdsim`, benchmarks).

The binary comes from tools/etcd/build.sh (built once from the official Go
module into the per-user cache). Each server gets its own data directory and
loopback ports; `stop`/`start` on the same directory keep the data, which is
how tests restart etcd under a running system. `EtcdCluster` runs several
members of one cluster the same way (HA tests: kill the leader, see who leads).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools import launch
from tools.cached_tool import BuildError, cached_tool
from tools.net_ports import free_port


class EtcdError(RuntimeError):
    pass


def etcd_binary() -> Path:
    """Path of the cached etcd binary, building it on first use."""
    override = os.environ.get("CD_ETCD_BINARY")
    if override:
        return Path(override)
    try:
        return cached_tool("tools/etcd/build.sh")
    except BuildError as exc:
        raise EtcdError(str(exc)) from None


def etcd_ctl_tools() -> tuple[Path, Path]:
    """Paths of the cached etcdctl and etcdutl (tools/etcd/build-ctl.sh), building them on first use."""
    try:
        directory = cached_tool("tools/etcd/build-ctl.sh")
    except BuildError as exc:
        raise EtcdError(str(exc)) from None
    return directory / "etcdctl", directory / "etcdutl"


@dataclass
class EtcdServer:
    data_dir: Path
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    binary: Path | None = None
    # TLS: when set, clients must use https with these files.
    cert_file: Path | None = None
    key_file: Path | None = None
    trusted_ca_file: Path | None = None
    client_cert_auth: bool = False
    # TLS between members too, with the same certificate (which then needs clientAuth as well).
    peer_tls: bool = False
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    # Member name and the cluster's "name=peer-url,..." (empty: a cluster of this one member).
    name: str = "default"
    initial_cluster: str = ""

    def __post_init__(self) -> None:
        if not self.client_port:
            self.client_port = free_port(self.host)
        if not self.peer_port:
            self.peer_port = free_port(self.host)
        if self.log_path is None:
            self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.cert_file else "http"

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.peer_tls else 'http'}://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        binary = self.binary or etcd_binary()
        client_url = f"{self.scheme}://{self.endpoint}"
        peer_url = self.peer_url
        cmd = [
            str(binary),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={peer_url}'}",
            "--log-level=warn",
            # Expiry checks are frequent enough for second-scale leases.
            "--unsafe-no-fsync" if os.environ.get("CD_ETCD_UNSAFE_NO_FSYNC") == "1" else "",
        ]
        if self.cert_file:
            cmd += [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
            if self.trusted_ca_file:
                cmd.append(f"--trusted-ca-file={self.trusted_ca_file}")
            if self.client_cert_auth:
                cmd.append("--client-cert-auth")
        if self.peer_tls:
            if not (self.cert_file and self.trusted_ca_file):
                raise EtcdError("peer TLS needs cert_file, key_file and trusted_ca_file")
            cmd += [
                f"--peer-cert-file={self.cert_file}",
                f"--peer-key-file={self.key_file}",
                f"--peer-trusted-ca-file={self.trusted_ca_file}",
                "--peer-client-cert-auth",
            ]
        return [c for c in cmd if c] + self.extra_args

    def start(self, timeout_s: float = 20.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting (a cluster's members wait for each other)."""
        if self.process is not None and self.process.poll() is None:
            raise EtcdError(f"etcd already running (pid {self.process.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        assert self.log_path is not None
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self, timeout_s: float = 1.0) -> dict[str, int]:
        """etcd's maintenance status of this member (its gRPC gateway): member_id, leader, raft_term.

        Raises EtcdError when the member does not answer."""
        context = None
        if self.cert_file:
            context = ssl.create_default_context(
                cafile=str(self.trusted_ca_file) if self.trusted_ca_file else None
            )
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        request = urllib.request.Request(
            f"{self.scheme}://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError) as exc:
            raise EtcdError(
                f"etcd member {self.name} at {self.endpoint} did not answer its status: {exc}"
            ) from None
        # The gateway writes 64-bit integers as strings (protobuf JSON).
        return {
            "member_id": int(doc["header"]["member_id"]),
            "leader": int(doc.get("leader", 0)),
            "raft_term": int(doc.get("raftTerm", 0)),
        }

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EtcdError(
                    f"etcd exited with {self.process.returncode} during start:\n{self.log_tail()}"
                )
            if self._port_open() and self._healthy():
                return
            time.sleep(0.05)
        raise EtcdError(f"etcd did not become ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        """etcd's /health answers true (over TLS with its own certificate as client, when TLS is on)."""
        context = None
        if self.cert_file:
            context = ssl.create_default_context(
                cafile=str(self.trusted_ca_file) if self.trusted_ca_file else None
            )
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        try:
            with urllib.request.urlopen(
                f"{self.scheme}://{self.endpoint}/health", timeout=1.0, context=context
            ) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.host, self.client_port), timeout=0.5):
                return True
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            launch.stop_process(self.process, timeout_s)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@dataclass
class EtcdCluster:
    """Several etcd members forming one cluster on loopback ports, each its own process."""

    members: list[EtcdServer]

    @classmethod
    def create(
        cls,
        root: Path,
        size: int = 3,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        tls: tuple[Path, Path, Path] | None = None,
    ) -> EtcdCluster:
        """`size` members under `root`; with `tls` (certificate, key, CA) clients and peers talk TLS
        and must present a certificate of that CA (the certificate serves and is each member's
        client certificate towards its peers)."""
        if size < 1:
            raise EtcdError(f"an etcd cluster needs at least one member, not {size}")
        cert, key, ca = tls if tls is not None else (None, None, None)
        members = [
            EtcdServer(
                data_dir=root / f"member-{i}",
                binary=binary,
                name=f"member-{i}",
                extra_args=list(extra_args),
                cert_file=cert,
                key_file=key,
                trusted_ca_file=ca,
                client_cert_auth=tls is not None,
                peer_tls=tls is not None,
            )
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        for member in members:
            member.initial_cluster = initial
        return cls(members)

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, "host:port,host:port,..." (the services' --etcd-endpoints)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 30.0) -> None:
        # All processes first: no member is healthy before a quorum has formed.
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_ready(timeout_s)

    def leader(self, timeout_s: float = 10.0) -> EtcdServer:
        """The member that leads now, as every running member that answers agrees on it."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen: dict[int, EtcdServer] = {}
            leaders: set[int] = set()
            for member in self.members:
                if not member.running:
                    continue
                try:
                    status = member.status()
                except EtcdError:
                    continue
                seen[status["member_id"]] = member
                leaders.add(status["leader"])
            if len(leaders) == 1:
                (leader_id,) = leaders
                if leader_id in seen:
                    return seen[leader_id]
            if time.monotonic() >= deadline:
                raise EtcdError(
                    f"no agreed etcd leader within {timeout_s:.0f}s (members report {sorted(leaders)})"
                )
            time.sleep(0.1)

    def destroy(self) -> None:
        for member in self.members:
            member.destroy()
