"""Cut a node's IMEX links: every simulated daemon on the node partitions its peer links.

Without root there is no packet filter to drop a node's traffic, so each daemon of the node is told
(its command service's ``CUT``) to behave as behind a dead switch port for a while: it reads, sends,
accepts and dials nothing on its peer links, both ways, and its peers see those links fall silent
and time out. Every process lives: the daemons, the IMEX agent (its node record and lease stay) and
the kubelet plugin. The daemons end the cut themselves.
"""

from __future__ import annotations

from pathlib import Path

from libs.invariants.processes import ProcessEntry, imex_daemons_under
from tools.sim.imex import client as simclient

MAX_CUT_S = 3600.0
COMMAND_TIMEOUT_S = 2.0


class NoDaemon(RuntimeError):
    """No simulated IMEX daemon runs on the node (or none took the fault)."""


def config_of(entry: ProcessEntry) -> str | None:
    """The ``-c <config>`` of a daemon's command line."""
    argv = list(entry.argv)
    if "-c" in argv and argv.index("-c") + 1 < len(argv):
        return argv[argv.index("-c") + 1]
    return None


async def cut_links(imex_dir: Path, seconds: float) -> dict[int, str]:
    """Cut the links of every daemon under `imex_dir` for `seconds`; returns pid -> domain dir name.

    Raises ValueError for a bad duration and NoDaemon when no daemon took the cut."""
    if not 0 < seconds <= MAX_CUT_S:
        raise ValueError(f"the cut must last (0, {MAX_CUT_S:g}] seconds, got {seconds}")
    cut: dict[int, str] = {}
    problems = []
    for entry in imex_daemons_under(imex_dir):
        config = config_of(entry)
        if config is None:
            continue
        try:
            host, port = simclient.command_endpoint(simclient.read_config(config))
            await simclient.inject_fault(
                host, port, simclient.CUT_LINKS, timeout=COMMAND_TIMEOUT_S, seconds=seconds
            )
        except (OSError, simclient.CommandEndpointError) as exc:
            problems.append(f"daemon pid {entry.pid}: {exc}")
            continue
        except (simclient.DaemonUnavailable, simclient.CommandRejected) as exc:
            problems.append(f"daemon pid {entry.pid} did not take the cut: {exc}")
            continue
        cut[entry.pid] = Path(config).parent.name
    if not cut:
        raise NoDaemon("; ".join(problems) or f"no IMEX daemon runs under {imex_dir}")
    return cut
