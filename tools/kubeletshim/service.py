"""The kubelet shim as a supervised service: the shim plus the /healthz side server every service has.

``cdsim up --kubernetes`` runs the shim under its supervisor, which restarts a process whose
/healthz stops answering. The shim itself has no side server, so this entry point takes two more
flags than ``python -m tools.kubeletshim`` and passes every other one through:

    --health-host HOST --health-port PORT

/healthz fails once the shim's run ended (it should not end before SIGTERM).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from libs.runtime.health import Health, start_health_server
from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit
from tools.kubeletshim.main import run_shim, shim_nodes
from tools.kubeletshim.nodes import NodesFileError, ShimNode
from tools.kubeletshim.settings import ShimSettings

log = structlog.get_logger(__name__)

PROG = "python -m tools.kubeletshim.service"


class UsageError(ValueError):
    """A flag of this entry point is missing or malformed; the message names it."""


def split_health_flags(argv: Sequence[str]) -> tuple[str, int, list[str]]:
    """(health host, health port, the shim's own flags) from argv; UsageError on a bad value."""
    host, port, rest = "127.0.0.1", -1, []
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        name, eq, inline = arg.partition("=")
        if name in ("--health-host", "--health-port"):
            if eq:
                value = inline
            elif i + 1 < len(items):
                i += 1
                value = items[i]
            else:
                raise UsageError(f"{name} needs a value")
            if name == "--health-host":
                host = value
            else:
                try:
                    port = int(value)
                except ValueError:
                    raise UsageError(f"--health-port must be a port number, got {value!r}") from None
                if not 0 <= port <= 65535:
                    raise UsageError(f"--health-port must be in [0, 65535], got {port}")
        else:
            rest.append(arg)
        i += 1
    if port < 0:
        raise UsageError("--health-port is required")
    return host, port, rest


async def _serve(settings: ShimSettings, nodes: Sequence[ShimNode], host: str, port: int) -> None:
    health = Health()
    runner, _ = await start_health_server(health, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        shim = asyncio.create_task(run_shim(settings, nodes, stop), name="kubelet-shim")
        health.watch_task("kubelet-shim", shim)
        await shim
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        host, port, rest = split_health_flags(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    settings = load_settings_or_exit(
        ShimSettings,
        rest,
        env_prefix="KUBELET_SHIM_",
        prog=PROG,
        description="The kubelet shim with a /healthz side server.",
    )
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    try:
        nodes = shim_nodes(settings)
    except (NodesFileError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if not nodes:
        print(f"{PROG}: no nodes to play", file=sys.stderr)
        return 2
    asyncio.run(_serve(settings, nodes, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
