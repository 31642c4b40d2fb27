"""``make bench``: run every benchmark in simulation, write the results and the report.

    python -m tools.bench.run [--quick] [--only formation,controller_churn] [--out build/bench/results.json]
        [--docs docs/benchmarks.md]

Each benchmark (`tools.bench.suite`) runs as its own process group with a timeout; its JSON goes
to ``build/bench/raw/<name>.json`` and its output to ``<name>.log`` there. A benchmark that fails
or times out leaves its metrics with ``value: null``, ``met: false`` and the error, and the others
still run. The results file::

    {"metrics": {NAME: {"value", "unit", "target", "met", "benchmark", "method", "settings", ["error"]}},
     "extras": {...same without a target...}, "quick": bool, "commit": sha, "dirty": bool,
     "machine": {...}, "plots": [path relative to the report, ...],
     "benchmarks": {name: {"summary", "module", "args", "seconds", "exit_code", "load_before",
                           "settled_s", ...}}}

Before each benchmark (full mode) the runner waits, up to 90 s, until the machine's CPUs are less
than 10 % busy over a second (``settled_s``: how long it waited).

Each metric's ``settings`` are what it was measured at (etcd's data on disk or tmpfs, fsync, the
checkpoint's durability, mesh mode, processes, calls, CPUs...): the benchmark's own ``settings``
object and the metric's (tools/bench/suite.py). Paths in it are relative to the repository.

Full mode regenerates ``docs/benchmarks.md`` and, beside it, ``docs/benchmarks.json`` (the same
results, committed with the report so it can be checked: the report is rendered from that file
alone, see :func:`tools.bench.report.render`), and the plots under ``docs/img/``; ``--quick`` (CI
smoke: small sizes, few repetitions, about two minutes) writes both under ``build/bench/`` and
marks every figure as quick.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tools.bench import report
from tools.bench.suite import SUITE, Benchmark

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "bench"
_STOP_GRACE_S = 60.0
_ERROR_TAIL_LINES = 12
# Before each benchmark: the machine's CPUs less than this busy over one window (at most the cap).
_QUIET_BUSY = 0.10
_QUIET_WINDOW_S = 1.0
_QUIET_CAP_S = 90.0


@dataclass
class Outcome:
    benchmark: Benchmark
    seconds: float
    exit_code: int | None
    raw: dict[str, Any] | None
    error: str
    load_before: float
    load_after: float
    # Seconds waited for an idle machine before it started.
    settled_s: float = 0.0


_REPORT_OUTPUTS = (":(exclude)docs/benchmarks.md", ":(exclude)docs/benchmarks.json", ":(exclude)docs/img")


def git_commit() -> tuple[str, bool]:
    """(HEAD sha, whether the work tree differs from it) — ("unknown", True) outside git.

    The report's own outputs (docs/benchmarks.md and .json, docs/img/) do not count: a previous run
    rewrote them, which says nothing about the code measured."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *_REPORT_OUTPUTS],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", True
    return sha, bool(status.strip())


def _meminfo_gb() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": _meminfo_gb(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in load],
        "shm_tmpfs": Path("/dev/shm").is_dir(),
    }


def _tail(path: Path, lines: int = _ERROR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the benchmark's process group (it cleans up), SIGKILL it after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of all the machine's CPUs since boot, from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return sum(ticks) - idle, sum(ticks)


def wait_for_quiet_machine(
    busy_below: float = _QUIET_BUSY,
    window_s: float = _QUIET_WINDOW_S,
    cap_s: float = _QUIET_CAP_S,
    read: Callable[[], tuple[int, int]] = cpu_times,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Wait until the machine's CPUs are less than `busy_below` busy over `window_s` (at most
    `cap_s`); the seconds waited. What the previous benchmark left running for a while (a control
    plane stopping, its etcd compacting, a thousand daemons exiting) would otherwise be measured
    with the next one: the 1-minute load average only tells of it afterwards."""
    began = clock()
    while clock() - began < cap_s:
        busy0, total0 = read()
        sleep(window_s)
        busy1, total1 = read()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < busy_below:
            break
    return round(clock() - began, 1)


def run_one(
    bench: Benchmark,
    quick: bool,
    raw_dir: Path,
    img_dir: Path,
    settle: Callable[[], float] = wait_for_quiet_machine,
) -> Outcome:
    """Run one benchmark (after `settle`, in full mode) as its own process group."""
    out = raw_dir / f"{bench.name}.json"
    log = raw_dir / f"{bench.name}.log"
    out.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        bench.module,
        *(bench.quick_args if quick else bench.full_args),
        "--out",
        str(out),
    ]
    if bench.plot_arg:
        img_dir.mkdir(parents=True, exist_ok=True)
        argv += [bench.plot_arg, str(img_dir / bench.plot_name)]
    timeout = bench.quick_timeout_s if quick else bench.full_timeout_s
    settled_s = 0.0 if quick else settle()
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    print(f"[bench] {bench.name}: {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    error = ""
    exit_code: int | None = None
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops all of it
        )
        try:
            exit_code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            error = f"timed out after {timeout:.0f} s"
        except BaseException:
            _stop_group(proc)
            raise
    seconds = time.monotonic() - began
    raw: dict[str, Any] | None = None
    if not error:
        try:
            raw = json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            error = f"exit code {exit_code}, no result ({type(exc).__name__}: {exc})"
    if error:
        tail = _tail(log)
        error = f"{error}\n{tail}" if tail else error
    status = "ok" if raw is not None else "FAILED"
    print(f"[bench] {bench.name}: {status} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return Outcome(bench, seconds, exit_code, raw, error, load_before, os.getloadavg()[0], settled_s)


def _repo_relative(path: Path) -> str:
    """A path as the results record it: relative to the repository when inside it (no machine paths)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def collect(outcomes: Sequence[Outcome], quick: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for o in outcomes:
        settings: dict[str, Any] = {}
        settings_error = ""
        if o.raw is not None:
            try:
                settings = dict(o.benchmark.settings(o.raw))
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                settings_error = f"settings not in the benchmark's result: {type(exc).__name__}: {exc}"
        for m in o.benchmark.metrics:
            entry: dict[str, Any] = {
                "value": None,
                "unit": m.unit,
                "target": m.target,
                "met": False,
                "benchmark": o.benchmark.name,
                "method": m.method,
                "settings": {**settings, **m.settings},
                **({"floor": m.floor} if m.floor else {}),
            }
            if o.raw is None:
                entry["error"] = o.error
            elif settings_error:
                # A figure whose settings are unknown is not a measurement of record.
                entry["error"] = settings_error
            else:
                try:
                    value = m.extract(o.raw)
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    entry["error"] = f"metric not in the benchmark's result: {type(exc).__name__}: {exc}"
                else:
                    entry["value"] = value
                    entry["met"] = m.met(value)
            if quick:
                entry["quick"] = True
            metrics[m.name] = entry
        for x in o.benchmark.extras:
            extra: dict[str, Any] = {
                "value": None,
                "unit": x.unit,
                "benchmark": o.benchmark.name,
                "method": x.method,
                "settings": {**settings, **x.settings},
            }
            if o.raw is not None:
                with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):
                    extra["value"] = x.extract(o.raw)
            extras[x.name] = extra
    return {"metrics": metrics, "extras": extras}


def results_path(docs: Path) -> Path:
    """The results committed beside a report: docs/benchmarks.md -> docs/benchmarks.json."""
    return docs.with_suffix(".json")


def rerender(docs: Path, source: Path | None) -> int:
    """Write the report again from its results (default: the JSON beside it)."""
    docs = docs.resolve()
    source = (source or results_path(docs)).resolve()
    results = json.loads(source.read_text())
    docs.write_text(report.render(results))
    print(f"[bench] report: {docs} (from {source})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI smoke)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--out", type=Path, default=BUILD / "results.json")
    parser.add_argument("--raw-dir", type=Path, help="where each benchmark's JSON and log go")
    parser.add_argument(
        "--docs", type=Path, help="the Markdown report (default: docs/benchmarks.md; quick: next to --out)"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="only write the report again from the results beside it (e.g. after editing the analysis)",
    )
    args = parser.parse_args(argv)
    if args.render_only:
        return rerender(args.docs or REPO / "docs" / "benchmarks.md", None)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - {b.name for b in SUITE})
    if unknown:
        parser.error(
            f"unknown benchmark(s): {', '.join(unknown)} (known: {', '.join(b.name for b in SUITE)})"
        )
    selected = [b for b in SUITE if not names or b.name in names]
    out: Path = args.out.resolve()
    raw_dir: Path = (args.raw_dir or out.parent / "raw").resolve()
    docs: Path = (
        args.docs or (out.parent / "benchmarks.md" if args.quick else REPO / "docs" / "benchmarks.md")
    ).resolve()
    img_dir = docs.parent / "img"
    raw_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A SIGTERM (make interrupted, CI timeout) unwinds like Ctrl-C so the running benchmark is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    commit, dirty = git_commit()
    before = machine()
    started = datetime.now(UTC)
    outcomes = [run_one(b, args.quick, raw_dir, img_dir) for b in selected]
    results: dict[str, Any] = {
        **collect(outcomes, args.quick),
        "quick": args.quick,
        "commit": commit,
        "dirty": dirty,
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "machine": {**before, "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "plots": report.draw_plots(raw_dir, img_dir, docs),
        "benchmarks": {
            o.benchmark.name: {
                "summary": o.benchmark.summary or o.benchmark.name,
                "module": o.benchmark.module,
                "args": list(o.benchmark.quick_args if args.quick else o.benchmark.full_args),
                "seconds": round(o.seconds, 1),
                "exit_code": o.exit_code,
                "ok": o.raw is not None,
                "load_before": round(o.load_before, 2),
                "load_after": round(o.load_after, 2),
                "settled_s": o.settled_s,
                "raw": _repo_relative(raw_dir / f"{o.benchmark.name}.json"),
                **({"error": o.error} if o.error else {}),
            }
            for o in outcomes
        },
    }
    text = json.dumps(results, indent=2, ensure_ascii=False) + "\n"
    out.write_text(text)
    docs.parent.mkdir(parents=True, exist_ok=True)
    results_path(docs).write_text(text)
    docs.write_text(report.render(results))
    print(report.table(results), file=sys.stderr)
    print(f"[bench] results: {out}, {results_path(docs)}\n[bench] report: {docs}", file=sys.stderr)
    return 0 if all(o.raw is not None for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
