"""Ctl tool of the simulated IMEX daemon, shaped like ``nvidia-imex-ctl``.

``python -m libs.imex.simulator.ctl [-c <config.cfg> | -i <IP> <PORT>] <query, command or fault>``

* ``-q``: print the local daemon's state (``READY``, ...) and exit 0; when the daemon cannot be
  reached print ``UNAVAILABLE``, give the reason on stderr and exit 1. Local only.
* ``-N``: this daemon's view of its domain: every node ID of its map, the address its name
  resolves to and the connection state (table; ``-j`` JSON, ``-H`` adds the names). Exit 0
  whatever the state, 1 when the daemon cannot be reached.
* ``--imports`` (``-j`` for JSON): the local jobs' memory imports and whether each is valid.
* ``--import JOB NODE_ID``: record that JOB imported memory from node NODE_ID (the link to it
  must be up); prints the exporter's instance. ``--unimport JOB`` drops JOB's imports.
* ``--inject crash|hang|heal`` or ``--inject drop-peer NODE_ID|ADDR``: fault injection; prints
  ``OK``.

A command the daemon declines, or a daemon that cannot be reached, exits 1 with the reason on
stderr. A config file that cannot be read, or names no usable command service, exits 255 (as
nvidia-imex-ctl does when it cannot read its configuration). ``--timeout`` (seconds) bounds the
call. The same calls are available in-process in ``libs.imex.simulator.client``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from libs.imex.simulator import client
from libs.imex.simulator import protocol as proto
from libs.imex.simulator.domain_status import build_nodes_report, format_imports_table, format_nodes_table

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 255
DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    try:
        if args.endpoint is not None:
            host, port = args.endpoint[0], int(args.endpoint[1])
        else:
            host, port = client.command_endpoint(client.read_config(args.config or DEFAULT_CONFIG))
    except OSError as exc:
        return _fail(f"Failed to read configuration file {exc.filename}: {exc.strerror}", EXIT_CONFIG)
    except (client.CommandEndpointError, ValueError) as exc:
        return _fail(str(exc), EXIT_CONFIG)
    try:
        return await _act(args, host, port)
    except client.DaemonUnavailable as exc:
        if args.query:
            print(proto.STATE_UNAVAILABLE)
        return _fail(str(exc), EXIT_FAILED)
    except client.CommandRejected as exc:
        return _fail(str(exc), EXIT_FAILED)


async def _act(args: argparse.Namespace, host: str, port: int) -> int:
    if args.query:
        print((await client.query_status(host, port, args.timeout)).state)
    elif args.nodes:
        report = build_nodes_report(
            await client.query_status(host, port, args.timeout), with_hostnames=args.hostnames
        )
        sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else format_nodes_table(report))
    elif args.imports:
        imports = await client.list_imports(host, port, args.timeout)
        if args.json:
            print(json.dumps([dataclasses.asdict(i) for i in imports], indent=2))
        else:
            sys.stdout.write(format_imports_table(imports))
    elif args.import_ is not None:
        job, node = args.import_
        if not node.isdigit():
            return _fail("--import takes JOB NODE_ID (a number)", EXIT_USAGE)
        print(await client.import_memory(host, port, job, int(node), args.timeout))
    elif args.unimport is not None:
        print(await client.unimport(host, port, args.unimport, args.timeout))
    else:
        fault, *rest = args.inject
        if fault not in client.FAULTS or (fault == "drop-peer") != (len(rest) == 1) or len(rest) > 1:
            return _fail("--inject takes crash | hang | heal | drop-peer NODE_ID|ADDR", EXIT_USAGE)
        await client.inject_fault(host, port, fault, rest[0] if rest else None, args.timeout)
        print(proto.REPLY_OK)
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
