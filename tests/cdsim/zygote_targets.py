"""Entry points the fork server tests run in forked children."""

from __future__ import annotations

import os
import sys
import time


def echo_and_exit() -> None:
    print(f"argv={sys.argv!r} env={os.environ.get('PROBE_VALUE')}")
    raise SystemExit(int(sys.argv[sys.argv.index("--code") + 1]))


def sleep_forever() -> None:
    while True:
        time.sleep(60)
