"""The Markdown report of a benchmark run (``docs/benchmarks.md``), from the results document.

Tables of every metric against its target (tools/bench/suite.py) and of the extra figures, the machine, how
each figure is measured and at which settings, the plots, and the hand-written analysis of missed targets
(``tools/bench/analysis.md``, written from profiles; kept beside the code it talks about).

:func:`render` reads nothing but the results (``docs/benchmarks.json``, committed beside the
report), that analysis and the suite's list of metrics (a metric the results predate is listed as
not measured), so the committed report can be checked against the committed results. The growth
curves (tools/bench/growth.py) are drawn as a plot and stated with their fitted exponents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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


def _floor(results: dict[str, Any], name: str) -> str:
    """The floor figure a metric names, as a cell: "" when it names none."""
    if not name:
        return ""
    x = (results.get("extras") or {}).get(name) or {}
    value = x.get("value")
    return f"{fmt(value)} {x['unit']} (`{name}`)" if value is not None else f"— (`{name}`)"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| Metric | Value | Target | Met | Floor, same run | Load average before |",
        "|---|---:|---|:---:|---|---:|",
    ]
    benchmarks: dict[str, Any] = results.get("benchmarks") or {}
    for name, m in results["metrics"].items():
        load = (benchmarks.get(m["benchmark"]) or {}).get("load_before")
        value = fmt(m["value"])
        if m["value"] is not None:
            value = f"{value} {m['unit']}"
        met = "yes" if m["met"] else ("**no**" if m["value"] is not None else "**failed**")
        lines.append(
            f"| `{name}` | {value} | {m['target']} | {met} | {_floor(results, m.get('floor', ''))} | {fmt(load)} |"
        )
    # Metrics of the suite that these results predate (or whose benchmark was not selected).
    for metric in _suite_metrics():
        if metric.name not in results["metrics"]:
            lines.append(f"| `{metric.name}` | not measured | {metric.target} | — | | |")
    return "\n".join(lines) + "\n"


def _suite_metrics() -> list[Any]:
    from tools.bench.suite import SUITE

    return [m for bench in SUITE for m in bench.metrics]


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


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "—"
    return str(value)


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{key} {_setting(value)}" for key, value in settings.items())


def _common_settings(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings every figure of a benchmark shares (each figure's own follow it)."""
    if not entries:
        return {}
    first: dict[str, Any] = entries[0].get("settings", {})
    return {
        k: v for k, v in first.items() if all(e.get("settings", {}).get(k, object()) == v for e in entries)
    }


def _methods(results: dict[str, Any]) -> str:
    parts: list[str] = []
    for name, info in results["benchmarks"].items():
        metrics = [(n, m) for n, m in results["metrics"].items() if m["benchmark"] == name]
        extras = [(n, x) for n, x in results["extras"].items() if x["benchmark"] == name]
        args = " ".join(info.get("args", []))
        parts.append(f"### {info.get('summary', name)}\n")
        parts.append(
            f"`python -m {info.get('module', name)}{' ' + args if args else ''}`"
            + f" — {info.get('seconds', 0):.0f} s, load average {info.get('load_before', 0)} before, "
            f"{info.get('load_after', 0)} after"
            + (
                f"; started after {info['settled_s']} s waiting for an idle machine"
                if info.get("settled_s")
                else ""
            )
            + ".\n"
        )
        common = _common_settings([e for _, e in metrics + extras])
        if common:
            parts.append(f"Settings: {_settings_text(common)}.\n")
        for label, entries in (("**`{}`**", metrics), ("`{}`", extras)):
            for figure, entry in entries:
                own = {k: v for k, v in entry.get("settings", {}).items() if k not in common}
                suffix = f" *Settings: {_settings_text(own)}.*" if own else ""
                parts.append(f"- {label.format(figure)} — {entry.get('method', '')}{suffix}")
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


_GROWTH_CURVES = (
    # (results key, x label, y label, extras of the points by size, exponent extra, bound on k);
    # the slope between the two largest sizes is the exponent extra's "_top" sibling.
    (
        "formation",
        "nodes",
        "formation time, submit to Ready (s)",
        {18: "growth_formation_18_s", 72: "growth_formation_72_s", 256: "growth_formation_256_s"},
        "growth_formation_exponent",
        1.0,
    ),
    (
        "controller",
        "domains",
        "controller CPU per store event (ms)",
        {d: f"controller_cpu_ms_per_event_{d}" for d in (100, 1000, 5000)},
        "growth_controller_cpu_per_event_exponent",
        0.0,
    ),
)


def growth_section(results: dict[str, Any]) -> str:
    """The two growth curves as numbers and their fitted exponents ("" before they were measured)."""
    from tools.bench.fit import TOLERANCE, verdict

    extras: dict[str, Any] = results.get("extras", {})
    metrics: dict[str, Any] = results.get("metrics", {})
    lines: list[str] = []
    for _, x, y, by_size, exponent_key, bound in _GROWTH_CURVES:
        points = {size: (extras.get(key) or {}).get("value") for size, key in by_size.items()}
        if x == "nodes":
            points[1008] = (metrics.get("formation_1008_s") or {}).get("value")
        exponent = (extras.get(exponent_key) or {}).get("value")
        top_key = exponent_key.replace("_exponent", "_top_exponent")
        # The formation's top exponent has a target (a metric); the controller's is an extra.
        top = (extras.get(top_key) or metrics.get(top_key) or {}).get("value")
        if exponent is None and all(v is None for v in points.values()):
            continue
        cells = ", ".join(f"{size:,} {x}: {fmt(v)}" for size, v in sorted(points.items()))
        if exponent is None:
            fitted = "not fitted"
        else:
            worst = max(exponent, top if top is not None else exponent)
            between = f", {top:.2f} between the two largest sizes" if top is not None else ""
            fitted = f"fitted k = {exponent:.2f}{between} ({verdict(worst, bound)}: k ≤ {bound:g} within {TOLERANCE})"
        lines.append(f"- **{y}** against {x} — {cells}; {y.split(' (')[0]} ~ {x}^k, {fitted}.")
    return "\n".join(lines) + "\n" if lines else ""


def growth_plot(raw_dir: Path, img_dir: Path) -> Path | None:
    """Both growth curves on log-log axes with their fitted power laws, if the growth benchmark ran."""
    try:
        raw = json.loads((raw_dir / "growth.json").read_text())
    except (OSError, ValueError):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.bench.fit import scale_factor

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), squeeze=False)
    for ax, (key, x, y, _, _, _) in zip(axes[0], _GROWTH_CURVES, strict=True):
        fit = raw.get(key, {}).get("fit", {})
        points = [(float(a), float(b)) for a, b in fit.get("points", [])]
        if not points:
            ax.set_visible(False)
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "o", label="measured")
        if "exponent" in fit:
            k = float(fit["exponent"])
            c = scale_factor(points, k)
            span = [min(xs), max(xs)]
            top = fit.get("top_exponent")
            label = f"fit ~ {x}^{k:.2f}" + (f", top slope {top:.2f}" if top is not None else "")
            ax.plot(span, [c * v**k for v in span], "--", label=f"{label} ({fit['verdict']})")
        if key == "formation":
            ax.axhline(30.0, color="red", linestyle=":", linewidth=1, label="1,008-node target 30 s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "growth.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_plots(raw_dir: Path, img_dir: Path, docs: Path) -> list[str]:
    """Draw the plots made from raw results; every plot now present, relative to the report."""
    formation_plot(raw_dir, img_dir)
    growth_plot(raw_dir, img_dir)
    present = [img_dir / "formation.png", img_dir / "advisor_stranded.png", img_dir / "growth.png"]
    return [os.path.relpath(p, docs.parent) for p in present if p.exists()]


def render(results: dict[str, Any]) -> str:
    quick = results["quick"]
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`tools/bench/run.py`) from `docs/benchmarks.json` (the results, "
        "committed beside this report); do not edit by hand. "
        "Every figure is measured in simulation on the machine below: simulated hardware and "
        "IMEX daemons, real etcd, real node-agent, controller and advisor code, at the settings "
        "each benchmark lists (etcd's data on disk and fsynced, the node agent's checkpoint saved as it "
        "ships).",
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
    plots: list[str] = results.get("plots", [])
    if plots:
        out += ["## Plots", ""]
        for rel in plots:
            out += [f"![{Path(rel).stem}]({rel})", ""]
    growth = growth_section(results)
    if growth:
        out += ["## How cost grows", "", growth]
    out += ["## How each figure is measured", "", _methods(results)]
    if ANALYSIS.exists() and not quick:
        out += [ANALYSIS.read_text().strip(), ""]
    return "\n".join(out).rstrip() + "\n"
