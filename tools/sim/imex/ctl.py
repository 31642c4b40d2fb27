"""Ctl tool of the simulated IMEX daemon, shaped like ``nvidia-imex-ctl``.

``python -m tools.sim.imex.ctl [-c <config.cfg> | -i <IP> <PORT>] <query, command or fault>``

* ``-q``: print the local daemon's state (``READY``, ...) and exit 0; when the daemon cannot be
  reached print ``UNAVAILABLE``, give the reason on stderr and exit 1. Local only.
* ``-N``: this daemon's view of its domain: every node ID of its map, the address its name
  resolves to and the connection state (table; ``-j`` JSON, ``-H`` adds the names). Exit 0
  whatever the state, 1 when the daemon cannot be reached. As nvidia-imex-ctl, the ctl reads
  the nodes config itself and resolves its names through ``/etc/hosts`` *where the ctl runs*:
  only inside the daemon's mount namespace (the IMEX agent bind-mounts the domain's hosts file
  over /etc/hosts there) do the slot names resolve. Elsewhere no node of the map can be reached
  and no node is shown connected (``domain_status.build_nodes_report``, ``seen``).
* ``--imports`` (``-j`` for JSON): the local jobs' memory imports and whether each is valid.
* ``--import JOB NODE_ID``: record that JOB imported memory from node NODE_ID (the link to it
  must be up); prints the exporter's instance. ``--unimport JOB`` drops JOB's imports.
* ``--inject crash|hang|heal`` or ``--inject drop-peer NODE_ID|ADDR``: fault injection; prints
  ``OK``.

A command the daemon declines, or a daemon that cannot be reached, exits 1 with the reason on
stderr. A config file that cannot be read, or names no usable command service, exits 255 (as
nvidia-imex-ctl does when it cannot read its configuration). ``--timeout`` (seconds) bounds the
call. The same calls are available in-process in ``tools.sim.imex.client``.

`run` is the ctl in-process, as if started with its root directory at ``root``: the IMEX agent
passes ``/proc/<daemon pid>/root``, which shows the files as the daemon's mount namespace does
(proc(5)), instead of paying an interpreter start per probe.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from libs.imex import config as keys
from libs.imex import slots
from libs.imex.config import parse_imex_config, parse_nodes_config
from tools.sim.imex import client
from tools.sim.imex import protocol as proto
from tools.sim.imex.domain_status import build_nodes_report, format_imports_table, format_nodes_table
from tools.sim.imex.resolver import is_ip

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 255
DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"
# What the system resolver reads first (nsswitch "files"); slot names end in .invalid, so DNS
# never resolves them.
ETC_HOSTS = "/etc/hosts"


@dataclasses.dataclass(frozen=True)
class CtlRun:
    """What one ctl call printed, and its exit status."""

    code: int
    stdout: str
    stderr: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imex-sim-ctl", description="Query or poke a simulated IMEX daemon."
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "-c", dest="config", metavar="CONFIG", help=f"nvidia-imex config path ({DEFAULT_CONFIG})"
    )
    target.add_argument(
        "-i", dest="endpoint", nargs=2, metavar=("IP", "PORT"), help="command service address"
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("-q", dest="query", action="store_true", help="print the local daemon's state")
    action.add_argument("-N", dest="nodes", action="store_true", help="print this daemon's links")
    action.add_argument("--imports", action="store_true", help="list the local jobs' imports")
    action.add_argument("--import", dest="import_", nargs=2, metavar=("JOB", "NODE_ID"), help="import")
    action.add_argument("--unimport", metavar="JOB", help="drop a job's imports")
    action.add_argument(
        "--inject", nargs="+", metavar="FAULT", help="inject a fault: crash | hang | heal | drop-peer PEER"
    )
    parser.add_argument("-j", dest="json", action="store_true", help="JSON output for -N and --imports")
    parser.add_argument("-H", dest="hostnames", action="store_true", help="show host names with -N")
    parser.add_argument(
        "--timeout",
        type=float,
        default=client.DEFAULT_TIMEOUT_S,
        help="seconds to wait for the daemon (default %(default)s)",
    )
    return parser


_PARSER: list[argparse.ArgumentParser] = []


def _parser() -> argparse.ArgumentParser:
    """The parser, built once per process (building it costs a probe more than its exchange)."""
    if not _PARSER:
        _PARSER.append(build_parser())
    return _PARSER[0]


def main(argv: list[str] | None = None) -> int:
    done = asyncio.run(run(sys.argv[1:] if argv is None else argv))
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.code


async def run(argv: Sequence[str], *, root: str = "/") -> CtlRun:
    """The ctl on `argv`, seeing the file system from `root` (``/``: its own mount namespace).

    Usage errors raise SystemExit, as argparse does."""
    args = _parser().parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    code = await _run(args, root, out, err)
    return CtlRun(code, out.getvalue(), err.getvalue())


def _in_root(root: str, path: str) -> str:
    """`path` as seen from `root` (a relative path is taken from the current directory)."""
    if root == "/":
        return path
    return os.path.join(root, os.path.abspath(path).lstrip("/"))


def _read_text(root: str, path: str) -> str:
    with open(_in_root(root, path), encoding="utf-8") as f:
        return f.read()


def resolve_nodes(names: Sequence[str], root: str = "/") -> dict[int, str]:
    """Node ID -> the address its entry resolves to where the ctl runs (unresolved ones left out):
    literal IPs, else ``/etc/hosts`` under `root`."""
    try:
        table = slots.parse_hosts(_read_text(root, ETC_HOSTS))
    except (OSError, UnicodeDecodeError):
        table = {}
    seen: dict[int, str] = {}
    for i, name in enumerate(names):
        address = name if is_ip(name) else table.get(name.lower(), "")
        if address:
            seen[i] = address
    return seen


async def _run(args: argparse.Namespace, root: str, out: TextIO, err: TextIO) -> int:
    config: dict[str, str] = {}
    try:
        if args.endpoint is not None:
            host, port = args.endpoint[0], int(args.endpoint[1])
        else:
            config = parse_imex_config(_read_text(root, args.config or DEFAULT_CONFIG))
            host, port = client.command_endpoint(config)
    except OSError as exc:
        return _fail(err, f"Failed to read configuration file {exc.filename}: {exc.strerror}", EXIT_CONFIG)
    except (client.CommandEndpointError, ValueError) as exc:
        return _fail(err, str(exc), EXIT_CONFIG)
    if args.nodes and args.endpoint is not None:
        return _fail(err, "-N needs the config file (-c): it reads the nodes config", EXIT_USAGE)
    try:
        return await _act(args, host, port, config, root, out, err)
    except client.DaemonUnavailable as exc:
        if args.query:
            print(proto.STATE_UNAVAILABLE, file=out)
        return _fail(err, str(exc), EXIT_FAILED)
    except client.CommandRejected as exc:
        return _fail(err, str(exc), EXIT_FAILED)


async def _nodes(
    args: argparse.Namespace, host: str, port: int, config: dict[str, str], root: str, out: TextIO
) -> int:
    """-N: the daemon's links, with the node names resolved here, not by the daemon."""
    nodes_file = config.get(keys.IMEX_NODE_CONFIG_FILE) or keys.DEFAULT_NODES_CONFIG_FILE
    try:
        names = parse_nodes_config(_read_text(root, nodes_file))
    except OSError as exc:
        raise client.CommandEndpointError(
            f"Failed to read node configuration file {exc.filename}: {exc.strerror}"
        ) from None
    status = await client.query_status(host, port, args.timeout)
    report = build_nodes_report(status, with_hostnames=args.hostnames, seen=resolve_nodes(names, root))
    # Compact: json's C encoder serves only that (indented, a probe spent a millisecond here).
    out.write(json.dumps(report) + "\n" if args.json else format_nodes_table(report))
    return EXIT_OK


async def _act(
    args: argparse.Namespace,
    host: str,
    port: int,
    config: dict[str, str],
    root: str,
    out: TextIO,
    err: TextIO,
) -> int:
    if args.query:
        print((await client.query_status(host, port, args.timeout)).state, file=out)
    elif args.nodes:
        try:
            return await _nodes(args, host, port, config, root, out)
        except client.CommandEndpointError as exc:
            return _fail(err, str(exc), EXIT_CONFIG)
    elif args.imports:
        imports = await client.list_imports(host, port, args.timeout)
        if args.json:
            print(json.dumps([dataclasses.asdict(i) for i in imports], indent=2), file=out)
        else:
            out.write(format_imports_table(imports))
    elif args.import_ is not None:
        job, node = args.import_
        if not node.isdigit():
            return _fail(err, "--import takes JOB NODE_ID (a number)", EXIT_USAGE)
        print(await client.import_memory(host, port, job, int(node), args.timeout), file=out)
    elif args.unimport is not None:
        print(await client.unimport(host, port, args.unimport, args.timeout), file=out)
    else:
        fault, *rest = args.inject
        if fault not in client.FAULTS or (fault == "drop-peer") != (len(rest) == 1) or len(rest) > 1:
            return _fail(err, "--inject takes crash | hang | heal | drop-peer NODE_ID|ADDR", EXIT_USAGE)
        await client.inject_fault(host, port, fault, rest[0] if rest else None, args.timeout)
        print(proto.REPLY_OK, file=out)
    return EXIT_OK


def _fail(err: TextIO, message: str, code: int) -> int:
    print(message, file=err)
    return code


if __name__ == "__main__":
    sys.exit(main())
