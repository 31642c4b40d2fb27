"""What the two ways `make image-smoke` runs a program of the image share: a named container of
an image running one command line with directories bind-mounted at the same path, the runtime's
client kept in the foreground with its output in a log file. Each runtime adds how it starts and
stops (tools/image/container.py for buildah, tools/containers/docker_run.py for docker)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class ContainerProgram:
    """One program of `image` in a container named `name`, with `binds` mounted."""

    def __init__(self, name: str, image: str, argv: list[str], binds: list[Path], log_file: Path) -> None:
        self.name = name
        self.image = image
        self.argv = argv
        self.binds = binds
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None

    def volume_args(self) -> list[str]:
        return [arg for path in self.binds for arg in ("--volume", f"{path}:{path}")]

    def spawn(self, command: list[str]) -> None:
        """Run the runtime's client `command` in the foreground of a session of its own (a Ctrl-C
        of the smoke run reaches the program only through stop()), its output to the log file."""
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        log.info("container_started", container=self.name, program=self.argv[0], pid=self.process.pid)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None
