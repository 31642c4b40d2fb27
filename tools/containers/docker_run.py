"""One program of the image in a docker container (`docker run`), as `make image-smoke --runtime
docker` runs the services: the same interface as tools/image/container.py's buildah container.

The docker client is the one on PATH, talking to the engine DOCKER_HOST names (the smoke's private
engine, tools/containers/engine.py). The container has the engine's host network (the engine's own
network namespace) and the run's state directory bind-mounted at the same path. `docker run` stays
in the foreground, its output going to the log file, so the program's log is there as it runs.

stop() first lists what the program started that still runs (an IMEX daemon the teardown should
have ended): it is reported, and ends with the container. Then SIGTERM through docker's init, and
SIGKILL only if the program outlives the grace period.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import structlog

from tools.image.container import ContainerError
from tools.image.program import ContainerProgram

log = structlog.get_logger(__name__)

DOCKER_TIMEOUT_S = 60.0
KILLED_EXIT_CODE = 137  # 128 + SIGKILL


def docker(*args: str, timeout_s: float = DOCKER_TIMEOUT_S) -> str:
    try:
        proc = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ContainerError(f"docker {' '.join(args)} did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        raise ContainerError(f"docker {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


class DockerContainer(ContainerProgram):
    """A container of `image` named `name`, running `argv` with `binds` mounted."""

    def __init__(
        self,
        name: str,
        image: str,
        argv: list[str],
        binds: list[Path],
        log_file: Path,
        sys_admin: bool = False,
        helpers: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, image, argv, binds, log_file)
        self.sys_admin = sys_admin
        # Substrings of the command lines of helpers the program keeps for its whole life (they
        # end with it): not reported by others().
        self.helpers = helpers
        self.left_behind: list[str] = []

    def start(self) -> None:
        command = ["docker", "run", "--name", self.name, "--network", "host", "--init", *self.volume_args()]
        if self.sys_admin:
            # What docker-compose.yml grants an IMEX agent (mount namespaces), not --privileged.
            command += ["--cap-add", "SYS_ADMIN", "--security-opt", "apparmor=unconfined"]
        self.spawn([*command, self.image, *self.argv])

    def others(self) -> list[str]:
        """What the program started that still runs in the container (pid and command): its
        descendants (not health probes or `docker exec` sessions, which the runtime starts)."""
        listing = docker("top", self.name, "-o", "pid,ppid,args")
        rows = [line.split(None, 2) for line in listing.splitlines()[1:] if line.strip()]
        init_pid = str(json.loads(docker("inspect", "--format", "{{json .State}}", self.name))["Pid"])
        children: dict[str, list[str]] = {}
        for pid, ppid, _ in rows:
            children.setdefault(ppid, []).append(pid)
        queue = [
            grandchild for program in children.get(init_pid, []) for grandchild in children.get(program, [])
        ]
        found = set()
        while queue:
            pid = queue.pop()
            found.add(pid)
            queue += children.get(pid, [])
        return [
            f"{pid} {args[:200]}"
            for pid, _, args in rows
            if pid in found and not any(helper in args for helper in self.helpers)
        ]

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """SIGTERM the program (through docker's init), SIGKILL after `grace_s`, remove the
        container. Returns the program's pid if it had to be killed; what else still ran before
        the stop is in `left_behind`."""
        killed: list[int] = []
        if self.process is None:
            return killed
        if self.running():
            self.left_behind = self.others()
            pid = int(json.loads(docker("inspect", "--format", "{{json .State}}", self.name))["Pid"])
            docker("stop", "--time", str(int(grace_s)), self.name, timeout_s=grace_s + 30)
            exit_code = int(docker("inspect", "--format", "{{.State.ExitCode}}", self.name))
            if exit_code == KILLED_EXIT_CODE:
                killed = [pid]
        self.process.wait(timeout=30.0)
        docker("rm", self.name)
        self.process = None
        log.info("container_stopped", container=self.name, killed=killed, left_behind=self.left_behind)
        return killed
