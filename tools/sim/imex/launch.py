"""How to start the simulated IMEX daemon as a process (for the node agent's supervisor).

`simulator_daemon_argv` is the command line of an exec'd daemon. `ForkServer` starts the same
daemon without a fresh interpreter (see ``fork_server.py``): the children have that same command
line, their own session, working directory and log, and the exit status is asked for once the
process is gone (`ForkedDaemon.wait`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_DAEMON_SCRIPT = str(Path(__file__).resolve().with_name("run_daemon.py"))
FORK_SERVER_SCRIPT = str(Path(__file__).resolve().with_name("fork_server.py"))
# Room for the children's command lines (interpreter, script and config paths).
_TITLE_ROOM = 4096
_ANSWER_TIMEOUT_S = 10.0


def simulator_daemon_argv(config_path: str, python: str | None = None) -> list[str]:
    """Return the argv that starts the simulated daemon on ``config_path``, fastest form.

    The tail is ``-c <config_path>``, exactly as for ``nvidia-imex``. ``-I -S`` keep the start
    cheap (no site-packages scan, no environment-driven imports); the daemon needs only the
    standard library and this repository.
    """
    return [python or sys.executable, "-I", "-S", RUN_DAEMON_SCRIPT, "-c", config_path]


class ForkServerError(OSError):
    """The fork server could not start a daemon or did not answer."""


class ForkedDaemon:
    """A daemon started by the fork server: `pid`, and `returncode` once `wait` was called after
    it exited (the fork server is its parent, so only it can reap it)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server

    def wait(self) -> int | None:
        """The exit status (Popen's convention); call once the process exited. None if unknown."""
        if self.returncode is None:
            try:
                self.returncode = self._server.returncode(self.pid)
            except ForkServerError:
                return None
        return self.returncode


class ForkServer:
    """Client of one fork server process: started on first use, started again if it died.

    Thread-safe: spawns run in worker threads, exit statuses are asked for on the event loop."""

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def spawn(
        self, argv: Sequence[str], cwd: Path, log_path: Path, hosts: Path | None = None
    ) -> ForkedDaemon:
        """Start the daemon of `argv` (a `simulator_daemon_argv`) in its own session, output
        appended to `log_path`, with `hosts` over /etc/hosts in a mount namespace of its own if
        given (libs/imex/hosts_ns.py). ForkServerError if it could not be started."""
        args = list(argv)
        if len(args) < 4 or args[3] != RUN_DAEMON_SCRIPT:
            raise ValueError(f"not a simulated daemon command line: {args}")
        request = {"op": "spawn", "argv": args, "args": args[4:], "cwd": str(cwd), "log": str(log_path)}
        if hosts is not None:
            request["hosts"] = str(hosts)
        answer = self._ask(request, retry=True)
        return ForkedDaemon(self, int(answer["pid"]))

    def returncode(self, pid: int) -> int | None:
        answer = self._ask({"op": "wait", "pid": pid}, retry=False)
        code = answer.get("returncode")
        return None if code is None else int(code)

    def close(self) -> None:
        """End the server (its daemons keep running)."""
        with self._lock:
            self._stop()

    def _ask(self, request: dict[str, Any], retry: bool) -> dict[str, Any]:
        line = (json.dumps(request) + "\n").encode()
        with self._lock:
            for attempt in (1, 2):
                try:
                    answer = self._exchange(line)
                    break
                except ForkServerError:
                    self._stop()
                    if attempt == 2 or not retry:
                        raise
        if "error" in answer:
            raise ForkServerError(f"fork server: {answer['error']}")
        return answer

    def _exchange(self, line: bytes) -> dict[str, Any]:
        proc = self._started()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
            # poll, not select: select refuses descriptors >= 1024, and a process hosting
            # hundreds of nodes (tools/sim/scalesim) holds more than that.
            poller = select.poll()
            poller.register(proc.stdout, select.POLLIN)
            ready = poller.poll(_ANSWER_TIMEOUT_S * 1000)
            reply = proc.stdout.readline() if ready else b""
        except OSError as exc:
            raise ForkServerError(f"fork server gone: {exc}") from exc
        if not reply:
            raise ForkServerError("fork server did not answer" if not ready else "fork server exited")
        answer: dict[str, Any] = json.loads(reply)
        return answer

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [self.python, "-I", "-S", FORK_SERVER_SCRIPT, "--title-room", "x" * _TITLE_ROOM],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This process's fork server (one for every supervisor it hosts)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ForkServer()
        return _shared


def _forget_after_fork() -> None:
    # A forked child (e.g. a service started by cdsim's zygote) must not share its parent's pipes.
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
