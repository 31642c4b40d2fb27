"""docs/benchmarks.md is what tools/bench/report.py renders from docs/benchmarks.json, the results
committed beside it: a report can be checked against the figures and settings it came from."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench import report
from tools.bench.suite import REQUIRED_METRICS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "docs" / "benchmarks.json"


def test_the_committed_report_is_rendered_from_the_committed_results() -> None:
    results = json.loads(RESULTS.read_text())
    assert DOCS.read_text() == report.render(results), (
        "docs/benchmarks.md differs from what docs/benchmarks.json renders: "
        "`make bench` writes both; after editing tools/bench/analysis.md, "
        "`python -m tools.bench.run --render-only`"
    )


def test_the_committed_results_are_a_full_run_with_every_metric_and_its_settings() -> None:
    results = json.loads(RESULTS.read_text())
    assert results["quick"] is False
    assert set(REQUIRED_METRICS) <= set(results["metrics"])
    for name, metric in results["metrics"].items():
        assert metric["settings"], f"{name} records no settings"
    for plot in results["plots"]:
        assert (DOCS.parent / plot).exists(), plot


def test_the_committed_results_name_no_path_of_the_machine_they_ran_on() -> None:
    assert str(REPO) not in RESULTS.read_text()
