"""The suite runner: one benchmark failing or hanging costs its own metrics only."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from tests.polling import wait_until
from tools.bench import report, run
from tools.bench.suite import Benchmark, Metric


def fake(name: str, *args: str, timeout_s: float = 60.0, threshold: float = 5.0) -> Benchmark:
    return Benchmark(
        name=name,
        module="tests.bench.fake_bench",
        full_args=args,
        quick_args=args,
        full_timeout_s=timeout_s,
        quick_timeout_s=timeout_s,
        metrics=(
            Metric(
                f"{name}_p99_ms",
                "ms",
                f"≤ {threshold} ms",
                threshold,
                True,
                lambda raw: float(raw["latency"]["p99_ms"]),
                "fake",
            ),
        ),
    )


def no_wait() -> float:
    return 0.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_failed_and_hung_benchmarks_are_reported_without_losing_the_others(tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    benches = [
        fake("fast", "--mode", "ok", "--value", "2.5"),
        fake("slow", "--mode", "ok", "--value", "7"),
        fake("broken", "--mode", "fail"),
        fake("stuck", "--mode", "hang", "--pidfile", str(pidfile), timeout_s=3),
    ]
    outcomes = [run.run_one(b, quick=True, raw_dir=tmp_path, img_dir=tmp_path / "img") for b in benches]
    metrics = run.collect(outcomes, quick=True)["metrics"]

    assert metrics["fast_p99_ms"]["value"] == 2.5 and metrics["fast_p99_ms"]["met"] is True
    assert metrics["slow_p99_ms"]["value"] == 7.0 and metrics["slow_p99_ms"]["met"] is False
    assert metrics["broken_p99_ms"]["value"] is None and metrics["broken_p99_ms"]["met"] is False
    assert "the store would not start" in metrics["broken_p99_ms"]["error"]
    assert metrics["stuck_p99_ms"]["value"] is None
    assert metrics["stuck_p99_ms"]["error"].startswith("timed out after 3 s")
    assert all(m["quick"] for m in metrics.values())

    # The timeout stopped the benchmark's whole process group, its helper process included.
    helper = int(pidfile.read_text())
    wait_until(lambda: not alive(helper), f"the benchmark's helper process {helper} to be stopped", 10)


def test_report_marks_missed_and_failed_metrics(tmp_path: Path) -> None:
    benches = [fake("fast", "--mode", "ok", "--value", "9"), fake("broken", "--mode", "fail")]
    outcomes = [
        run.run_one(b, quick=False, raw_dir=tmp_path, img_dir=tmp_path / "img", settle=no_wait)
        for b in benches
    ]
    results = {
        **run.collect(outcomes, quick=False),
        "quick": False,
        "commit": "abc",
        "dirty": False,
        "started_at": "2026-01-01T00:00:00+00:00",
        "duration_s": 1.0,
        "machine": {**run.machine(), "load_average_after": [0.0, 0.0, 0.0]},
        "benchmarks": {
            o.benchmark.name: {"args": [], "seconds": o.seconds, **({"error": o.error} if o.error else {})}
            for o in outcomes
        },
    }
    text = report.render(results)
    assert "| `fast_p99_ms` | 9.00 ms | ≤ 5.0 ms | **no** |" in text
    assert "| `broken_p99_ms` | — | ≤ 5.0 ms | **failed** |" in text
    assert "the store would not start" in text


def test_each_metric_records_the_settings_it_was_measured_at(tmp_path: Path) -> None:
    bench = fake("fast", "--mode", "ok", "--value", "2", "--settings", '{"etcd_data": "disk (ext4)"}')
    metric = bench.metrics[0]
    bench = replace(bench, metrics=(replace(metric, settings={"rpc": "PlaceStream"}),))
    outcome = run.run_one(bench, quick=False, raw_dir=tmp_path, img_dir=tmp_path / "img", settle=no_wait)
    entry = run.collect([outcome], quick=False)["metrics"]["fast_p99_ms"]
    assert entry["settings"] == {"etcd_data": "disk (ext4)", "rpc": "PlaceStream"}
    assert entry["value"] == 2.0 and entry["method"] == "fake"


def test_a_figure_without_its_settings_is_not_reported(tmp_path: Path) -> None:
    bench = fake("bare", "--mode", "ok", "--value", "2", "--settings", "")
    outcome = run.run_one(bench, quick=False, raw_dir=tmp_path, img_dir=tmp_path / "img", settle=no_wait)
    entry = run.collect([outcome], quick=False)["metrics"]["bare_p99_ms"]
    assert entry["value"] is None and "settings not in the benchmark's result" in entry["error"]


def test_each_benchmark_waits_for_an_idle_machine_within_a_cap() -> None:
    """Busy (half the CPU ticks) for three windows, then idle: it starts after the fourth window;
    a machine that never settles delays it by the cap, not for ever."""
    now = [0.0]
    busy_per_window = iter([50, 50, 50, 5])
    totals = [0, 0]  # busy, total ticks

    def read() -> tuple[int, int]:
        return totals[0], totals[1]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        totals[0] += next(busy_per_window)
        totals[1] += 100

    assert run.wait_for_quiet_machine(0.10, 1.0, 90.0, read, sleep, lambda: now[0]) == 4.0

    def sleep_busy(seconds: float) -> None:
        now[0] += seconds
        totals[0] += 80
        totals[1] += 100

    now[0] = 0.0
    assert run.wait_for_quiet_machine(0.10, 1.0, 5.0, read, sleep_busy, lambda: now[0]) == 5.0
    busy, total = run.cpu_times()
    assert 0 <= busy <= total
