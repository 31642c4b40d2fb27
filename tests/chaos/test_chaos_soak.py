"""The chaos soak, short: over two minutes of random jobs and every kind of fault on an 18-node
rack, with the invariants of docs/state-model.md checked all along and at the end (`make chaos` runs 30 minutes),
and invariant 6: running jobs' workload imports survive every fault that does not replace one of
their daemons, and a killed node comes back with its index.

The seed is fresh each run (or $CHAOS_SEED) and printed on failure with the soak's event log, so
a failure can be replayed with `python -m tools.chaos --seed S --duration 130 --racks 1`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests import address_blocks
from tools.chaos import plan

pytestmark = pytest.mark.slow

DURATION_S = 130  # at least two minutes of faults, beyond cluster start and final checks
ADDRESS_BLOCK = address_blocks.CHAOS_SOAK
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_invariants_hold_through_random_jobs_and_faults(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**31))
    summary_file = tmp_path / "summary.json"
    command = [
        sys.executable, "-m", "tools.chaos",
        "--duration", str(DURATION_S),
        "--seed", str(seed),
        "--racks", "1",
        "--trays", "18",
        "--address-block", str(ADDRESS_BLOCK),
        "--quiesce-every", "35,55",
        "--summary-json", str(summary_file),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=840, check=False)
    shown = f"seed {seed}\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, shown
    summary = json.loads(summary_file.read_text())
    counts = summary["counts"]
    assert summary["ok"] and summary["violations"] == [], shown
    # It did what it says: every kind of fault, jobs that formed and were torn down, checks.
    missing = [f for f in plan.FAULTS if not counts.get(f"fault {f}")]
    assert not missing, f"faults never injected: {missing}\n{shown}"
    assert counts.get("job submit ok", 0) >= 3 and counts.get("job delete ok", 0) >= 1, shown
    assert counts.get("check 1-3", 0) >= 100 and counts.get("phase quiescence", 0) >= 2, shown
    assert counts.get("check cluster idle") == 1, shown
    inv6 = sum(n for name, n in counts.items() if name.startswith("check inv6 job imports intact"))
    assert inv6 >= 3 and counts.get("job imports ok", 0) >= 3, shown
    assert summary["elapsed_s"] >= DURATION_S
