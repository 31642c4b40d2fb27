"""The Markdown report of a benchmark run (``docs/benchmarks.md``), from the results document.

Tables of every metric against its target (tools/bench/suite.py) and of the extra figures, the machine, how
each figure is measured, the plots, and the hand-written analysis of missed targets
(``tools/bench/analysis.md``, written from profiles; kept beside the code it talks about).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.bench.suite import Benchmark

ANALYSIS = Path(__file__).with_name("analysis.md")


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    if value == int(value) and abs(value) >= 10:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table(results: dict[str, Any]) -> str:
    lines = ["| Metric | Value | Target | Met |", "|---|---:|---|:---:|"]
    for name, m in results["metrics"].items():
        value = fmt(m["value"])
        if m["value"] is not None:
            value = f"{value} {m['unit']}"
        met = "yes" if m["met"] else ("**no**" if m["value"] is not None else "**failed**")
        lines.append(f"| `{name}` | {value} | {m['target']} | {met} |")
    return "\n".join(lines) + "\n"


def _extras_table(results: dict[str, Any]) -> str:
    lines = ["| Figure | Value |", "|---|---:|"]
    for name, x in results["extras"].items():
        value = fmt(x["value"])
        lines.append(f"| `{name}` | {value}{' ' + x['unit'] if x['value'] is not None else ''} |")
    return "\n".join(lines) + "\n"


def _machine(results: dict[str, Any]) -> str:
    m = results["machine"]
    rows = [
        ("CPUs", f"{m['cpus']} x {m['cpu_model']}"),
        ("Memory", f"{m['memory_gb']} GB"),
        ("Python", m["python"]),
        ("Platform", m["platform"]),
        ("Load average (1/5/15 min) before", " / ".join(str(x) for x in m["load_average"])),
        ("Load average after", " / ".join(str(x) for x in m["load_average_after"])),
        (
            "Commit",
            f"`{results['commit']}`{' (work tree had uncommitted changes)' if results['dirty'] else ''}",
        ),
        (
            "Run",
            f"{results['started_at']}, {results['duration_s']:.0f} s{', QUICK' if results['quick'] else ''}",
        ),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines) + "\n"


def _methods(results: dict[str, Any], benchmarks: Sequence[Benchmark]) -> str:
    parts: list[str] = []
    for bench in benchmarks:
        info = results["benchmarks"].get(bench.name, {})
        args = " ".join(info.get("args", []))
        parts.append(f"### {bench.summary or bench.name}\n")
        parts.append(
            f"`python -m {bench.module}{' ' + args if args else ''}`"
            + f" — {info.get('seconds', 0):.0f} s, load average {info.get('load_before', 0)} before, "
            f"{info.get('load_after', 0)} after.\n"
        )
        for m in bench.metrics:
            parts.append(f"- **`{m.name}`** — {m.method}")
        for x in bench.extras:
            parts.append(f"- `{x.name}` — {x.method}")
        if info.get("error"):
            parts.append(f"\n**This benchmark failed:**\n\n```\n{info['error']}\n```")
        parts.append("")
    return "\n".join(parts)


def formation_plot(raw_dir: Path, img_dir: Path) -> Path | None:
    """Per-repetition formation times (ready and prepared), if the formation benchmark ran."""
    try:
        raw = json.loads((raw_dir / "formation.json").read_text())
    except (OSError, ValueError):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [(k, raw[k]) for k in ("formation_18", "formation_256") if k in raw]
    if not scenarios:
        return None
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 3.4), squeeze=False)
    for ax, (key, data) in zip(axes[0], scenarios, strict=True):
        runs = data["formations"]
        xs = range(1, len(runs) + 1)
        ax.bar([x - 0.2 for x in xs], [r["prepared_s"] for r in runs], width=0.4, label="all claims prepared")
        ax.bar([x + 0.2 for x in xs], [r["ready_s"] for r in runs], width=0.4, label="domain Ready")
        target = raw.get("targets", {}).get(
            "formation_18_p50_s" if key == "formation_18" else "formation_256_s"
        )
        if target:
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target} s")
        ax.set_title(f"{data['nodes']} nodes over {data['racks']} rack(s)")
        ax.set_xlabel("repetition")
        ax.set_ylabel("seconds since submit")
        ax.set_xticks(list(xs))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "formation.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(
    results: dict[str, Any], benchmarks: Sequence[Benchmark], docs: Path, img_dir: Path, raw_dir: Path
) -> str:
    quick = results["quick"]
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`tools/bench/run.py`) from `build/bench/results.json`; do not edit by hand. "
        "Every figure is measured in simulation on the machine below: simulated hardware and "
        "IMEX daemons, real etcd, real node-agent, controller and advisor code.",
        "",
    ]
    if quick:
        out += [
            "> **QUICK RUN** (CI smoke): reduced sizes and repetitions; these figures do not measure the "
            "targets.",
            "",
        ]
    out += ["## Results against the targets", "", table(results)]
    if results["extras"]:
        out += ["## Other figures", "", _extras_table(results)]
    out += ["## Machine", "", _machine(results)]
    plots = [
        p for p in (formation_plot(raw_dir, img_dir), img_dir / "advisor_stranded.png") if p and p.exists()
    ]
    if plots:
        out += ["## Plots", ""]
        for path in plots:
            rel = os.path.relpath(path, docs.parent)
            out += [f"![{path.stem}]({rel})", ""]
    out += ["## How each figure is measured", "", _methods(results, benchmarks)]
    if ANALYSIS.exists() and not quick:
        out += [ANALYSIS.read_text().strip(), ""]
    return "\n".join(out).rstrip() + "\n"
