"""How cost grows, and the API server writes of a Kubernetes formation: fits, audit counts, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench import growth, report, run
from tools.bench.audit_log import AuditReader, parse_line, summarize
from tools.bench.fit import fit_exponent, top_exponent, verdict
from tools.bench.scaling import GROWTH

REPO = Path(__file__).resolve().parents[2]


def test_the_fitted_exponent_is_the_power_of_the_growth() -> None:
    assert fit_exponent([(18, 0.9), (72, 3.6), (256, 12.8), (1008, 50.4)]) == pytest.approx(1.0)
    assert fit_exponent([(100, 0.3), (1000, 0.3), (5000, 0.3)]) == pytest.approx(0.0, abs=1e-12)
    assert fit_exponent([(10, 1.0), (100, 100.0)]) == pytest.approx(2.0)
    # Flat small sizes pull the fit down; the slope between the largest two does not hide the rise.
    flat_then_steep = [(18, 1.0), (72, 1.0), (256, 1.0), (1024, 16.0)]
    assert fit_exponent(flat_then_steep) < 1.0 and top_exponent(flat_then_steep) == pytest.approx(2.0)
    assert (
        growth.curve([{"nodes": x, "s": y} for x, y in flat_then_steep], "nodes", "s", 1.0)["verdict"]
        == "worse than linear"
    )
    assert verdict(1.05, 1.0) == "linear or better"
    assert verdict(1.3, 1.0) == "worse than linear"
    assert verdict(0.25, 0.0) == "worse than linear"
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_exponent([(18, 1.0), (18, 1.2)])


def _audit(stage: str, verb: str, agent: str, resource: str, at: str, sub: str = "", code: int = 200) -> str:
    ref = {"resource": resource, "namespace": "bench", **({"subresource": sub} if sub else {})}
    return json.dumps(
        {
            "kind": "Event",
            "apiVersion": "audit.k8s.io/v1",
            "level": "Metadata",
            "stage": stage,
            "verb": verb,
            "userAgent": agent,
            "objectRef": ref,
            "responseStatus": {"metadata": {}, "code": code},
            "requestReceivedTimestamp": at,
        }
    )


def test_writes_are_counted_once_per_request_and_attributed_by_user_agent(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = [
        _audit(
            "ResponseComplete",
            "patch",
            "cd-controller/bench-controller",
            "computedomains",
            "2026-01-01T00:00:01.000000Z",
            "status",
        ),
        _audit(
            "ResponseComplete",
            "patch",
            "cd-controller/bench-controller",
            "nodes",
            "2026-01-01T00:00:01.500000Z",
        ),
        _audit(
            "ResponseComplete",
            "create",
            "cd-node-agent/scalesim",
            "resourceslices",
            "2026-01-01T00:00:02.000000Z",
            code=409,
        ),
        _audit(
            "ResponseComplete",
            "create",
            "kube-scheduler/v1.37.2 (linux/amd64)",
            "pods",
            "2026-01-01T00:00:02.000000Z",
            "binding",
        ),
        _audit(
            "ResponseComplete",
            "patch",
            "OpenAPI-Generator/31.0.0/python",
            "pods",
            "2026-01-01T00:00:03.000000Z",
            "status",
        ),
        _audit(
            "ResponseStarted",
            "patch",
            "cd-controller/bench-controller",
            "nodes",
            "2026-01-01T00:00:03.000000Z",
        ),
        _audit(
            "ResponseComplete",
            "get",
            "cd-controller/bench-controller",
            "nodes",
            "2026-01-01T00:00:03.000000Z",
        ),
        _audit(
            "ResponseComplete",
            "patch",
            "cd-controller/bench-controller",
            "nodes",
            "2026-01-01T00:00:09.000000Z",
        ),
    ]
    # The last line is still being written when the reader first looks.
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])
    reader = AuditReader(log)
    start = parse_line(lines[0])
    assert start is not None and start.ours
    window = reader.between(start.at, start.at + 5)
    with log.open("a") as f:
        f.write(lines[-1][40:] + "\n")
    counts = summarize(window, nodes=2)
    assert counts["ours"] == 3 and counts["ours_per_node"] == 1.5 and counts["ours_failed"] == 1
    assert counts["ours_by_kind"] == {
        "cd-controller patch computedomains/status": 1,
        "cd-controller patch nodes": 1,
        "cd-node-agent create resourceslices": 1,
    }
    assert counts["all"] == 5
    assert counts["by_component"]["kube-scheduler"] == 1 and counts["by_component"]["kubelet shim"] == 1
    # The line completed later is read once, whole.
    assert len(reader.between(0, 2e9)) == 6


def _results(outcomes: list[run.Outcome], quick: bool = False) -> dict[str, Any]:
    return {
        **run.collect(outcomes, quick=quick),
        "quick": quick,
        "commit": "abc",
        "dirty": False,
        "started_at": "2026-01-01T00:00:00+00:00",
        "duration_s": 1.0,
        "machine": {**run.machine(), "load_average_after": [0.0, 0.0, 0.0]},
        "benchmarks": {o.benchmark.name: {"args": [], "seconds": o.seconds} for o in outcomes},
    }


def test_growth_curves_are_reported_with_their_fits_and_drawn(tmp_path: Path) -> None:
    formations = [{"nodes": n, "reps": 1, "ready_p50_s": 0.05 * n**0.8} for n in (18, 72, 256, 1008)]
    controllers = [{"domains": d, "cpu_ms_per_event": 0.2 * d**0.4} for d in (100, 1000, 5000)]
    raw = {
        "benchmark": "growth",
        "settings": {"etcd_data": "disk (ext4)"},
        "formation": {
            "sizes": formations,
            "largest_ready_p50_s": formations[-1]["ready_p50_s"],
            "fit": growth.curve(formations, "nodes", "ready_p50_s", 1.0),
        },
        "controller": {
            "sizes": controllers,
            "fit": growth.curve(controllers, "domains", "cpu_ms_per_event", 0.0),
        },
    }
    (tmp_path / "growth.json").write_text(json.dumps(raw))
    outcome = run.Outcome(GROWTH, 1.0, 0, raw, "", 0.0, 0.0)
    results = _results([outcome])
    assert results["metrics"]["formation_1008_s"]["value"] == pytest.approx(0.05 * 1008**0.8)
    assert results["metrics"]["formation_1008_s"]["met"] is True
    assert results["extras"]["controller_cpu_ms_per_event_1000"]["value"] == pytest.approx(0.2 * 1000**0.4)
    text = report.render(results)
    assert "## How cost grows" in text
    assert "fitted k = 0.80, 0.80 between the two largest sizes (linear or better: k ≤ 1 within 0.1)" in text
    assert "fitted k = 0.40, 0.40 between the two largest sizes (worse than linear: k ≤ 0 within 0.1)" in text
    plot = report.growth_plot(tmp_path, tmp_path / "img")
    assert plot is not None and plot.stat().st_size > 10_000


def test_metrics_the_results_do_not_hold_are_listed_as_not_measured() -> None:
    results = json.loads((REPO / "docs" / "benchmarks.json").read_text())
    for name in ("formation_256_s", "k8s_formation_256_s", "k8s_writes_per_node"):
        results["metrics"].pop(name, None)
    text = report.render(results)
    assert "| `formation_256_s` | not measured | ≤ 10 s | — |" in text
    assert "| `k8s_formation_256_s` | not measured | ≤ 30 s | — |" in text
    assert "| `k8s_writes_per_node` | not measured | ≤ 2 per node | — |" in text
