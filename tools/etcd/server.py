"""Run a real etcd server as a subprocess (tests, `cdsim`, benchmarks).

The binary comes from tools/etcd/build.sh (built once from the official Go
module into the per-user cache). Each server gets its own data directory and
loopback ports; `stop`/`start` on the same directory keep the data, which is
how tests restart etcd under a running system.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tools.cachedtool import BuildError, cached_tool
from tools.netports import free_port


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
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None

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

    def command(self) -> list[str]:
        binary = self.binary or etcd_binary()
        client_url = f"{self.scheme}://{self.endpoint}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            str(binary),
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
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
        return [c for c in cmd if c] + self.extra_args

    def start(self, timeout_s: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            raise EtcdError(f"etcd already running (pid {self.process.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        assert self.log_path is not None
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EtcdError(f"etcd exited with {self.process.returncode} during start:\n{self.log_tail()}")
            if self._port_open() and self._healthy():
                return
            time.sleep(0.05)
        raise EtcdError(f"etcd did not become ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        """etcd's /health answers true (over TLS with its own certificate as client, when TLS is on)."""
        context = None
        if self.cert_file:
            context = ssl.create_default_context(cafile=str(self.trusted_ca_file) if self.trusted_ca_file else None)
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        try:
            with urllib.request.urlopen(f"{self.scheme}://{self.endpoint}/health", timeout=1.0, context=context) as resp:
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
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

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
