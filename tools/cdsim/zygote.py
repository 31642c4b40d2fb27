"""A fork server for the simulated cluster's Python services.

Starting a service the ordinary way costs most of a second of CPU in imports (grpc, aiohttp,
betterproto, ...); 36 node agents on a 2-core machine would take ~15 s before doing anything.
The zygote imports the service modules once, then forks one child per request: each child is a
real, separate process (its own pid, killable, restartable) that starts with everything imported.

It is safe because the zygote stays single-threaded and never opens a gRPC channel or an event
loop before forking; the children create their own.

Protocol (JSON lines): requests on stdin, answers and exit events on stdout.

    -> {"id": 1, "op": "spawn", "name": "agent-rack0-tray0", "target": "pkg.mod:main",
        "argv": ["--flag", "v"], "log": "/path/to/log", "env": {"K": "V"}}
    <- {"id": 1, "pid": 4242}            or {"id": 1, "error": "..."}
    <- {"event": "exit", "pid": 4242, "code": 1, "signal": 0}

When stdin closes (the supervisor is gone) the zygote terminates its children and exits, so a
dead supervisor leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

_PR_SET_NAME = 15
_TERMINATE_GRACE_S = 5.0


def _set_process_name(name: str) -> None:
    """Show the service in `ps -o comm` / top (15 bytes at most); cosmetic, best effort."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def resolve_target(target: str) -> Callable[[], Any]:
    module_name, _, func_name = target.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"target {target!r} must be 'module:function'")
    module = importlib.import_module(module_name)
    func = getattr(module, func_name)
    if not callable(func):
        raise ValueError(f"{target} is not callable")
    return func


def _run_child(request: dict[str, Any], inherited_fds: list[int]) -> None:
    """In the forked child: detach from the zygote's plumbing and run the service's main. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for fd in inherited_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        if devnull != 0:
            os.dup2(devnull, 0)
            os.close(devnull)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for target in (1, 2):
            if log_fd != target:
                os.dup2(log_fd, target)
        if log_fd > 2:
            os.close(log_fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _set_process_name(str(request.get("name", "")))
        os.environ.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
        sys.argv = [str(request.get("name", "service")), *[str(a) for a in request.get("argv", [])]]
        main = resolve_target(str(request["target"]))
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Zygote:
    def __init__(self, out: Any) -> None:
        self.out = out
        self.children: set[int] = set()

    def emit(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def spawn(self, request: dict[str, Any], inherited_fds: list[int]) -> None:
        rid = request.get("id")
        try:
            if request.get("op") != "spawn":
                raise ValueError(f"unknown op {request.get('op')!r}")
            for field in ("target", "log"):
                if not isinstance(request.get(field), str):
                    raise ValueError(f"spawn request needs a string {field!r}")
            pid = os.fork()
        except (OSError, ValueError) as exc:
            self.emit({"id": rid, "error": str(exc)})
            return
        if pid == 0:
            _run_child(request, inherited_fds)
        self.children.add(pid)
        self.emit({"id": rid, "pid": pid})

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            self.emit(
                {"event": "exit", "pid": pid, "code": code if code >= 0 else None, "signal": max(0, -code)}
            )

    def terminate_children(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while self.children and time.monotonic() < deadline:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.reap()
            time.sleep(0.05)
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken module must not stop the others; the child reports it
            print(f"zygote: preloading {name} failed: {exc!r}", file=sys.stderr, flush=True)


def serve(modules: list[str]) -> int:
    preload(modules)
    stdin_fd = sys.stdin.fileno()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    zygote = Zygote(out)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # The supervisor decides when we stop (it closes our stdin); a terminal's Ctrl-C must not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inherited = [stdin_fd, out.fileno(), wake_r, wake_w]
    selector = selectors.DefaultSelector()
    selector.register(stdin_fd, selectors.EVENT_READ, "stdin")
    selector.register(wake_r, selectors.EVENT_READ, "signal")
    buffer = b""
    try:
        while True:
            for key, _ in selector.select(timeout=1.0):
                if key.data == "signal":
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    continue
                chunk = os.read(stdin_fd, 65536)
                if not chunk:
                    return 0
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    try:
                        request = json.loads(line)
                    except ValueError as exc:
                        zygote.emit({"id": None, "error": f"bad request: {exc}"})
                        continue
                    zygote.spawn(request, inherited)
            zygote.reap()
    except BrokenPipeError:
        return 0
    finally:
        zygote.terminate_children()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cdsim-zygote", description=__doc__.splitlines()[0])
    parser.add_argument("--preload", default="", help="comma-separated modules to import before forking")
    # Only there so that every process of one cluster names its state dir on the command line.
    parser.add_argument("--state-dir", default="", help="the cluster's state directory")
    args = parser.parse_args(argv)
    return serve([m for m in args.preload.split(",") if m])


if __name__ == "__main__":
    raise SystemExit(main())
