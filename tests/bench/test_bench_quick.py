"""`make bench --quick` end to end: every benchmark of tools/bench/suite.py runs and yields its figures.

Targets are not asserted here: a smoke run on a busy CI machine measures nothing; `make bench`
compares the figures with the targets and writes them down.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.scaling import GROWTH
from tools.bench.suite import REQUIRED_METRICS, SUITE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_quick_suite_reports_every_metric_with_a_number(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    docs = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.run", "--quick", "--out", str(out), "--docs", str(docs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=700,
        check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    results = json.loads(out.read_text())

    assert results["quick"] is True
    assert isinstance(results["commit"], str) and results["commit"]
    machine = results["machine"]
    assert machine["cpus"] >= 1 and machine["memory_gb"] > 0 and machine["python"]
    assert len(machine["load_average"]) == 3

    metrics = results["metrics"]
    assert set(REQUIRED_METRICS) <= set(metrics)
    failed = {name: m.get("error") for name, m in metrics.items() if m["value"] is None}
    assert not failed, failed
    for name, m in metrics.items():
        assert isinstance(m["value"], int | float) and math.isfinite(m["value"]), name
        # A growth exponent may come out below zero at the quick run's small sizes, where the
        # larger formation can be the faster one; every other figure is a time, rate or count.
        assert m["value"] >= 0 or name.endswith("_exponent"), name
        assert isinstance(m["unit"], str) and m["unit"], name
        assert isinstance(m["target"], str) and m["target"], name
        assert isinstance(m["met"], bool), name
        assert m["quick"] is True, name
    # The quick growth run measures other sizes than the points its figures are named for; the
    # quick prepare run reads claims from the store, so it has no API server GET to measure.
    missing = [
        name
        for name, x in results["extras"].items()
        if x["value"] is None and x["benchmark"] != GROWTH.name and name != "floor_kube_get_p99_ms"
    ]
    assert not missing, f"figures the suite names but the benchmarks did not report: {missing}"
    assert {b.name for b in SUITE} == set(results["benchmarks"])
    assert all(b["ok"] for b in results["benchmarks"].values())
    assert proc.returncode == 0, proc.stderr[-3000:]

    text = docs.read_text()
    assert "QUICK RUN" in text
    for name in REQUIRED_METRICS:
        assert f"`{name}`" in text
