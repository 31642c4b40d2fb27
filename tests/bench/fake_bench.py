"""A stand-in benchmark for the suite runner's tests: succeeds, fails or hangs as told."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ok", "fail", "hang"), required=True)
    parser.add_argument("--value", type=float, default=1.0)
    parser.add_argument("--pidfile", type=Path)
    parser.add_argument("--settings", default="{}", help="the settings object to report (JSON; empty: none)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.mode == "ok":
        result = {"latency": {"p99_ms": args.value}}
        if args.settings:
            result["settings"] = json.loads(args.settings)
        args.out.write_text(json.dumps(result))
        return 0
    if args.mode == "fail":
        print("fake benchmark: the store would not start", file=sys.stderr)
        return 3
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if args.pidfile is not None:
        args.pidfile.write_text(str(helper.pid))
    time.sleep(600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
