"""`cdctl`: inspect a running ComputeDomain system from its store.

    cdctl get domains|members|nodes|cliques|reservations|daemons [-n NS | -A] [-o table|json]
    cdctl describe domain NAME [-n NS]

The store is found with `--etcd-endpoint` (and the TLS / auth flags), or else from a running
`cdsim` cluster (its state directory: `--state-dir`, `$CDSIM_STATE_DIR` or the default one).
Exit status: 0 success, 1 failure (not found, store unreachable), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TextIO

import aetcd.exceptions

from libs.runtime.logging import configure_logging
from libs.state.store import TRANSIENT_ERRORS, Store
from tools.cdctl import snapshot
from tools.cdctl.connection import add_connection_flags, etcd_config
from tools.cdctl.describe import describe_domain
from tools.cdctl.views import ALIASES, BUILDERS, KINDS, format_table


class CdctlError(RuntimeError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdctl", description="Inspect ComputeDomains from the state store.")
    connection = argparse.ArgumentParser(add_help=False)
    add_connection_flags(connection)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    get = sub.add_parser("get", parents=[connection], help="list records as a table or JSON")
    get.add_argument("kind", choices=[*KINDS, *ALIASES], metavar="KIND", help=" | ".join(KINDS))
    scope = get.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="only this namespace (domains, members, daemons)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace (the default)")
    get.add_argument("-o", "--output", choices=("table", "json"), default="table")
    describe = sub.add_parser("describe", parents=[connection], help="explain one object")
    describe.add_argument("kind", choices=("domain", "cd", "computedomain"), metavar="KIND", help="domain")
    describe.add_argument("name")
    describe.add_argument("-n", "--namespace", default="default")
    return parser


async def _load(args: argparse.Namespace) -> snapshot.Snapshot:
    try:
        config = etcd_config(args)
    except ValueError as exc:
        raise CdctlError(str(exc)) from None
    store = Store(config)
    try:
        await asyncio.wait_for(store.connect(), timeout=config.timeout_s)
        return await snapshot.load(store)
    except (*TRANSIENT_ERRORS, aetcd.exceptions.ClientError) as exc:
        raise CdctlError(f"cannot read the store at {config.endpoint}: {exc or type(exc).__name__}") from None
    finally:
        await store.close()


async def run(args: argparse.Namespace, out: TextIO) -> None:
    snap = await _load(args)
    now_ms = int(time.time() * 1000)
    if args.command == "get":
        kind = ALIASES.get(args.kind, args.kind)
        view = BUILDERS[kind](snap, now_ms, args.namespace)
        if args.output == "json":
            out.write(json.dumps({"kind": kind, "items": view.documents}, indent=2) + "\n")
        elif not view.rows:
            scope = f" in namespace {args.namespace}" if args.namespace else ""
            out.write(f"No {kind} found{scope}.\n")
        else:
            out.write(format_table(view.headers, view.rows) + "\n")
        return
    matches = [d for d in snap.domains if d.name == args.name and d.namespace == args.namespace]
    if not matches:
        others = sorted(f"{d.namespace}/{d.name}" for d in snap.domains if d.name == args.name)
        hint = f" (found in: {', '.join(others)}; use -n)" if others else ""
        raise CdctlError(f"no ComputeDomain {args.namespace}/{args.name}{hint}")
    out.write(describe_domain(snap, matches[0], now_ms) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("console", "critical", stream=sys.stderr)
    try:
        asyncio.run(run(args, sys.stdout))
    except CdctlError as exc:
        print(f"cdctl: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
