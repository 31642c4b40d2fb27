"""`python -m tools.chaos --duration SECONDS [--seed N]`: the chaos soak on a fresh cdsim cluster.

Exit status: 0 when every invariant held from start to end, 1 on a violation (the seed, the
violations and the whole event log are printed; the cluster's logs are kept), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from pathlib import Path

from libs.runtime.logging import configure_logging
from tools.chaos.soak import Soak
from tools.chaos.tracking import SoakOptions


def _pair(text: str, cast: type[int] | type[float]) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        a, b = cast(low), cast(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH numbers, got {text!r}") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected 0 < LOW <= HIGH, got {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.chaos",
        description="Random jobs and real faults on a simulated NVL72 cluster; the invariants of docs/state-model.md are "
        "checked all along and after quiescence. Seeded: the same seed makes the same decisions.",
    )
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of faults (default 1800)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    parser.add_argument("--racks", type=int, default=2, help="NVL72 racks (default 2)")
    parser.add_argument("--trays", type=int, default=18, help="trays per rack (default 18)")
    parser.add_argument(
        "--address-block", type=int, default=60, help="second octet of the node addresses (default 60)"
    )
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="cluster state dir (default: a temp dir)"
    )
    parser.add_argument(
        "--quiesce-every",
        type=lambda t: tuple(int(x) for x in _pair(t, int)),
        default=(60, 110),
        metavar="LOW,HIGH",
        help="steps between quiescences, drawn from this range (default 60,110)",
    )
    parser.add_argument(
        "--step-delay",
        type=lambda t: _pair(t, float),
        default=(0.4, 2.0),
        metavar="LOW,HIGH",
        help="seconds between steps, drawn from this range (default 0.4,2.0)",
    )
    parser.add_argument(
        "--settle", type=float, default=60.0, help="seconds a quiescence may take to converge"
    )
    parser.add_argument("--keep-up", action="store_true", help="leave the cluster running after a failure")
    parser.add_argument("--quiet", action="store_true", help="do not print events as they happen")
    parser.add_argument(
        "--summary-json", type=Path, default=None, help="also write the result (counts, violations) here"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration <= 0:
        print("--duration must be > 0", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    # The soak's own store reads may log skipped garbage values; its report says what matters.
    configure_logging("console", "critical", stream=sys.stderr)
    options = SoakOptions(
        duration_s=args.duration,
        seed=seed,
        racks=args.racks,
        trays=args.trays,
        address_block=args.address_block,
        state_dir=args.state_dir,
        quiesce_every=args.quiesce_every,
        step_delay_s=args.step_delay,
        settle_s=args.settle,
        keep_up=args.keep_up,
        echo=not args.quiet,
    )
    soak = Soak(options, sys.stdout)
    ok = asyncio.run(soak.run())
    print(soak.report(ok), flush=True)
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(soak.summary(ok), indent=2) + "\n")
    soak.cleanup(ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
