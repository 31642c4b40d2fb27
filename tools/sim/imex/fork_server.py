"""Fork server of the simulated IMEX daemon, run as a script:
``python -I -S <repo>/tools/sim/imex/fork_server.py --title-room <padding>``.

A fresh interpreter costs the simulated daemon 30 ms of CPU before its first line of work, 65 ms
with the TLS mesh (``ssl``), a cost the real ``nvidia-imex`` (a native binary) does not have: a
256-node formation on a 2-core machine spent seconds of its critical path starting interpreters.
This server imports the daemon once and forks one child per start. Each child is what an
exec'd daemon is: a separate process in its own session, with the working directory and output
file asked for, its command line rewritten to the daemon's argv (process scans and pidfile-less
adoption find it by its config path, as they find an exec'd one), running the daemon's ``main``.

It is safe because the server stays single-threaded, opens no sockets and starts no event loop.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout.

    {"op": "spawn", "argv": [...], "args": ["-c", cfg], "cwd": dir, "log": file,
     "hosts": file (optional: the child gets a mount namespace with it over /etc/hosts,
     libs/imex/hosts_ns.py)} -> {"pid": n}
    {"op": "wait", "pid": n} -> {"returncode": code}   (code as subprocess.Popen's; null if unknown)
    any failure -> {"error": "..."}

At EOF on stdin (its agent is gone) the server exits and its daemons keep running: they outlive
their agent, whose next incarnation adopts them.
"""

import json
import os
import sys
import traceback

if __name__ == "__main__":
    # This file is <root>/tools/sim/imex/fork_server.py; put <root> on the path (-I omits it).
    sys.path.insert(0, __file__[: -len("tools/sim/imex/fork_server.py")] or ".")

# Reaped children whose status nobody asked for yet; bounded (an answer nobody asks for is dropped).
_MAX_KEPT_STATUSES = 4096


def set_cmdline(argv: list[str]) -> None:
    """Rewrite this process's command line in place (what /proc/<pid>/cmdline and ps show).

    The new argv must fit the room of the one the process started with (the server starts with a
    padding argument for this); ValueError if it does not."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    start, end = int(fields[45]), int(fields[46])  # proc(5) fields 48, 49: arg_start, arg_end
    data = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    if len(data) > end - start:
        raise ValueError(f"command line of {len(data)} bytes does not fit the room of {end - start}")
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(data.ljust(end - start, b"\0"))


def returncode(status: int) -> int:
    """A wait status as subprocess.Popen reports it: the exit code, or -N for signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(request: dict, main: object) -> None:
    """In the forked child: become the daemon the request describes. Never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        set_cmdline(request["argv"])
        if request.get("hosts"):
            from libs.imex.hosts_ns import NamespaceError, enter_private_hosts  # loaded by main()

            try:
                enter_private_hosts(request["hosts"])
            except NamespaceError as exc:
                print(f"cannot give the daemon its own /etc/hosts: {exc.strerror}", file=sys.stderr)
                raise SystemExit(1) from None
        code = main(list(request["args"]))  # type: ignore[operator]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class _Server:
    def __init__(self, main: object) -> None:
        self.main = main
        self.statuses: dict[int, int] = {}

    def reap(self) -> None:
        """Collect exited children (no zombie outlives the next request)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.statuses[pid] = returncode(status)
            if len(self.statuses) > _MAX_KEPT_STATUSES:
                del self.statuses[next(iter(self.statuses))]

    def answer(self, request: dict) -> dict:
        op = request.get("op")
        if op == "spawn":
            for key in ("argv", "args", "cwd", "log"):
                if key not in request:
                    return {"error": f"spawn request without {key!r}"}
            if not os.path.isdir(request["cwd"]):
                return {"error": f"working directory {request['cwd']} does not exist"}
            pid = os.fork()
            if pid == 0:
                _run_child(request, self.main)
            return {"pid": pid}
        if op == "wait":
            pid = int(request["pid"])
            self.reap()
            return {"returncode": self.statuses.pop(pid, None)}
        return {"error": f"unknown op {op!r}"}

    def serve(self) -> int:
        for line in sys.stdin:
            self.reap()
            try:
                reply = self.answer(json.loads(line))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        return 0


def main() -> int:
    from libs.imex import hosts_ns
    from tools.sim.imex import daemon, mesh_tls  # noqa: F401  (mesh_tls: ssl, paid once here)

    hosts_ns.load_libc()  # ctypes and libc, paid once here too

    return _Server(daemon.main).serve()


if __name__ == "__main__":
    sys.exit(main())
