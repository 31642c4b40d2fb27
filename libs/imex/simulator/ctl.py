"""Ctl tool of the simulated IMEX daemon, shaped like ``nvidia-imex-ctl``.

``python -m libs.imex.simulator.ctl [-c <config.cfg> | -i <IP> <PORT>] <query or fault>``

* ``-q``: print the local daemon's state (``READY``, ``WAITING_FOR_PEERS``, ...) and exit 0; when
  the daemon cannot be reached print ``UNAVAILABLE``, give the reason on stderr and exit 1.
* ``-N``: query every node of the nodes config (at ``<address>:IMEX_CMD_PORT``) and print the
  domain table; ``-j`` prints it as JSON instead, ``-H`` adds host names. Exit 0 whatever the
  domain state.
* ``--inject crash|hang|heal`` or ``--inject drop-peer <ADDR>``: fault injection (sim only);
  prints ``OK``, exit 0, or the reason on stderr and exit 1.

A config file that cannot be read, or names no usable command service, exits 255 (as
nvidia-imex-ctl does when it cannot read its configuration). ``--timeout`` (seconds) bounds every
network call. The same queries are available in-process in ``libs.imex.simulator.client``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from libs.imex.simulator import client
from libs.imex.simulator import protocol as proto
from libs.imex.simulator.domain_status import format_nodes_table

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
    action.add_argument("-N", dest="nodes", action="store_true", help="print the whole domain's status")
    action.add_argument(
        "--inject",
        nargs="+",
        metavar="FAULT",
        help="inject a fault: crash | hang | heal | drop-peer ADDR",
    )
    parser.add_argument("-j", dest="json", action="store_true", help="JSON output for -N")
    parser.add_argument("-H", dest="hostnames", action="store_true", help="show host names with -N")
    parser.add_argument(
        "--timeout",
        type=float,
        default=client.DEFAULT_TIMEOUT_S,
        help="seconds to wait for each daemon (default %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    config: dict[str, str] = {}
    try:
        if args.endpoint is not None:
            if args.nodes:
                return _fail("-N needs the config file (-c), not -i", EXIT_USAGE)
            host, port = args.endpoint[0], int(args.endpoint[1])
        else:
            config = client.read_config(args.config or DEFAULT_CONFIG)
            host, port = client.command_endpoint(config)
    except OSError as exc:
        return _fail(f"Failed to read configuration file {exc.filename}: {exc.strerror}", EXIT_CONFIG)
    except (client.CommandEndpointError, ValueError) as exc:
        return _fail(str(exc), EXIT_CONFIG)

    if args.query:
        try:
            status = await client.query_status(host, port, args.timeout)
        except client.DaemonUnavailable as exc:
            print(proto.STATE_UNAVAILABLE)
            return _fail(str(exc), EXIT_FAILED)
        print(status.state)
        return EXIT_OK

    if args.nodes:
        try:
            addresses = client.read_nodes(config)
        except OSError as exc:
            return _fail(
                f"Failed to read node configuration file {exc.filename}: {exc.strerror}", EXIT_CONFIG
            )
        report = await client.query_nodes(addresses, port, args.timeout, with_hostnames=args.hostnames)
        sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else format_nodes_table(report))
        return EXIT_OK

    fault, *rest = args.inject
    if fault not in client.FAULTS or (fault == "drop-peer") != (len(rest) == 1) or len(rest) > 1:
        return _fail("--inject takes crash | hang | heal | drop-peer ADDR", EXIT_USAGE)
    try:
        await client.inject_fault(host, port, fault, rest[0] if rest else None, args.timeout)
    except (client.DaemonUnavailable, client.CommandRejected) as exc:
        return _fail(str(exc), EXIT_FAILED)
    print(proto.REPLY_OK)
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
