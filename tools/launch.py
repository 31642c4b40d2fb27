"""Start a service process with its settings, wait until it is healthy, stop it gracefully.

The one launcher of the benchmarks and the tests that run a service as its own process (a
`python -m services.<name>.main` with command-line settings, or a tool such as `tools.sim.scalesim`).
Its output goes to a log file, which a failure quotes. Stopping is what a kubelet does to a
container: SIGTERM, then SIGKILL once a bounded grace has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The entry module of each service, by the name the launcher knows it by.
SERVICE_MODULES: Mapping[str, str] = {
    "node-agent": "services.nodeagent.main",  # the kubelet plugin
    "imex-agent": "services.imexagent.main",
    "controller": "services.controller.main",
    "advisor": "services.advisor.main",
}
# The log events (JSON log format) in which a service says which port it bound (port 0 in its
# settings: the kernel picks) -> the name `announced_ports` gives that port.
PORT_EVENTS: Mapping[str, str] = {
    "gRPC listening": "grpc",
    "extender listening": "extender",
    "health server listening": "health",
}
STOP_GRACE_S = 15.0
# After SIGKILL a process is gone at once unless the kernel is stuck; this bounds the wait anyway.
KILL_WAIT_S = 10.0
TAIL_CHARS = 2000


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, with the repository importable (and `extra` on top)."""
    return {**os.environ, "PYTHONPATH": str(REPO), **(extra or {})}


def service_argv(service: str, settings: Sequence[str], python_args: Sequence[str] = ()) -> list[str]:
    """The command line of `service` with its settings (`python_args`, such as a profiler, go
    before the module)."""
    try:
        module = SERVICE_MODULES[service]
    except KeyError:
        raise ValueError(
            f"unknown service {service!r}; known: {', '.join(sorted(SERVICE_MODULES))}"
        ) from None
    return [sys.executable, *python_args, "-m", module, *settings]


def service_target(service: str) -> str:
    """`module:function` of `service`'s entry point, for a fork server that preloaded its module."""
    return f"{SERVICE_MODULES[service]}:main"


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (exited, not yet reaped by its parent) does not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def terminate(pid: int, grace_s: float = STOP_GRACE_S, poll_s: float = 0.05) -> None:
    """SIGTERM `pid` (a process this one did not start as a child, such as a fork server's), then
    SIGKILL if it still runs after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; returns once it is reaped."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(KILL_WAIT_S)


@dataclass
class Launched:
    """One process started here, its output in `log`."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = TAIL_CHARS) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_process(self.proc, grace_s)

    def wait_healthy(
        self,
        healthy: Callable[[], bool],
        timeout_s: float,
        what: str,
        poll_s: float = 0.1,
        max_poll_s: float = 0.0,
    ) -> None:
        """Poll `healthy()` (an OSError counts as not yet) every `poll_s`, backing off to
        `max_poll_s` if that is larger, until it holds. The process exiting first, or `timeout_s`
        passing, stops it and raises a RuntimeError that quotes its log."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if healthy():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not {what} within {timeout_s:.0f}s: {self.tail()}")
            time.sleep(poll_s)
            poll_s = max(poll_s, min(poll_s * 1.5, max_poll_s))


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    append: bool = False,
) -> Launched:
    """Start `argv` with no stdin, stdout and stderr to `log` (truncated, or appended to: a
    restart's log follows the previous run's), in `env` (default `child_env()`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as out:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env) if env is not None else child_env(),
            stdin=subprocess.DEVNULL,  # a service reads no terminal
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Launched(name, proc, log)


def start_service(
    service: str,
    settings: Sequence[str],
    log: Path,
    *,
    name: str = "",
    python_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    append: bool = False,
) -> Launched:
    """Start `service` (a key of SERVICE_MODULES) with `settings`; `name` defaults to the service."""
    return spawn(name or service, service_argv(service, settings, python_args), log, env=env, append=append)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers 200 (a health or readiness endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def metrics(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0) -> dict[str, float]:
    """The Prometheus samples of the health server at `host:port` (series with labels -> value)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def announced_ports(log: Path) -> dict[str, int]:
    """The ports a service logged it listens on so far (`grpc`, `extender`, `health`), read from
    its JSON log; lines that are not JSON are skipped."""
    ports: dict[str, int] = {}
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return ports
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        name = PORT_EVENTS.get(line.get("event", "")) if isinstance(line, dict) else None
        if name is not None and "port" in line:
            ports[name] = int(line["port"])
    return ports
