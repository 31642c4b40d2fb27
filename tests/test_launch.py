"""tools/launch.py: a process that exits or never gets healthy fails with its log; a stop ends
even a process that ignores SIGTERM, within its grace; ports are read from a service's JSON log."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tools import launch

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_an_exit_before_healthy_fails_at_once_quoting_the_log(tmp_path: Path) -> None:
    started = launch.spawn(
        "quitter", [sys.executable, "-c", "print('bad flag --x'); raise SystemExit(2)"], tmp_path / "q.log"
    )
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"quitter exited 2: bad flag --x"):
        started.wait_healthy(lambda: False, timeout_s=30, what="healthy")
    assert time.monotonic() - began < 10


def test_not_healthy_in_time_stops_the_process(tmp_path: Path) -> None:
    started = launch.spawn(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log"
    )
    with pytest.raises(RuntimeError, match=r"sleeper not ready within 0s"):
        started.wait_healthy(lambda: False, timeout_s=0.3, what="ready")
    assert not started.running()


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    started = launch.spawn("stubborn", [sys.executable, "-c", IGNORES_SIGTERM], tmp_path / "t.log")
    started.wait_healthy(lambda: "ready" in started.log.read_text(), timeout_s=30, what="ready", poll_s=0.02)
    began = time.monotonic()
    started.stop(grace_s=0.5)
    took = time.monotonic() - began
    assert started.proc.returncode == -signal.SIGKILL
    assert 0.5 <= took < 5


def test_terminate_ends_a_pid_that_ignores_sigterm(tmp_path: Path) -> None:
    started = launch.spawn("stubborn", [sys.executable, "-c", IGNORES_SIGTERM], tmp_path / "t.log")
    started.wait_healthy(lambda: "ready" in started.log.read_text(), timeout_s=30, what="ready", poll_s=0.02)
    launch.terminate(started.pid, grace_s=0.3)
    assert started.proc.wait(5) == -signal.SIGKILL
    assert not launch.pid_alive(started.pid)


def test_a_restart_appends_to_the_log_when_asked(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    for word in ("first", "second"):
        launch.spawn("echo", [sys.executable, "-c", f"print({word!r})"], log, append=True).proc.wait(30)
    assert log.read_text().split() == ["first", "second"]
    launch.spawn("echo", [sys.executable, "-c", "print('third')"], log).proc.wait(30)
    assert log.read_text().split() == ["third"]


def test_announced_ports_come_from_the_json_log(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    lines = [
        "not json",
        json.dumps({"event": "gRPC listening", "socket": "/run/x.sock"}),  # no port: skipped
        json.dumps({"event": "gRPC listening", "host": "127.0.0.1", "port": 4100}),
        json.dumps({"event": "health server listening", "port": 4101}),
        json.dumps({"event": "inventory synced"}),
    ]
    log.write_text("\n".join(lines) + "\n")
    assert launch.announced_ports(log) == {"grpc": 4100, "health": 4101}
    assert launch.announced_ports(tmp_path / "missing.log") == {}


def test_an_unknown_service_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown service 'controler'; known: advisor, controller"):
        launch.service_argv("controler", [])
    argv = launch.service_argv("controller", ["--identity=a"], python_args=["-X", "dev"])
    assert argv[1:] == ["-X", "dev", "-m", "services.controller.main", "--identity=a"]
