"""Generate the configuration and metrics reference of docs/operations.md from the code.

    python -m tools.gen_settings_docs            rewrite the generated sections in place
    python -m tools.gen_settings_docs --check    exit 1 (saying so) if the doc is not current

Each program's settings class and environment prefix are read from its entry point's own
`load_settings_or_exit(...)` or `run_service(...)` call (libs/runtime/service.py), and its metrics from its metrics class, so the doc cannot
drift from what the programs accept and export. The generated text sits between
`<!-- BEGIN GENERATED: <name> -->` and `<!-- END GENERATED: <name> -->` markers; everything
else in the doc is written by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from prometheus_client.metrics_core import Metric

from libs.fsio.atomic import write_atomic

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "operations.md"
DEFAULT_ENV_PREFIX = "CD_"  # load_settings' default


@dataclass(frozen=True)
class ProgramDoc:
    title: str
    command: str  # how it is started
    target: str  # module:function, the entry point
    # module:Class whose registry /metrics serves, or a prometheus Collector class that /metrics
    # serves (scrape-time gauges of what the program runs; built here with nothing running).
    metrics: str


PROGRAMS = (
    ProgramDoc(
        "Domain controller",
        "cd-controller",
        "services.controller.main:main",
        "services.controller.metrics:ControllerMetrics",
    ),
    ProgramDoc(
        "Node agent",
        "cd-node-agent",
        "services.nodeagent.main:main",
        "services.nodeagent.shell.metrics:AgentMetrics",
    ),
    ProgramDoc(
        "IMEX agent",
        "cd-imex-agent",
        "services.imexagent.main:main",
        "services.imexagent.main:DaemonCollector",
    ),
    ProgramDoc(
        "Placement advisor",
        "cd-placement-advisor",
        "services.advisor.main:main",
        "services.advisor.metrics:AdvisorMetrics",
    ),
    ProgramDoc(
        "Dashboard",
        "python -m tools.dashboard",
        "tools.dashboard.main:main",
        "tools.dashboard.metrics:DashboardMetrics",
    ),
)


def _load(reference: str) -> Any:
    module_name, _, name = reference.partition(":")
    return getattr(importlib.import_module(module_name), name)


def settings_of_entry_point(target: str) -> tuple[type, str]:
    """(settings class, environment prefix) of an entry point, from its `load_settings_or_exit` or
    `run_service` call (both take the settings class first)."""
    module = importlib.import_module(target.partition(":")[0])
    tree = ast.parse(Path(module.__file__ or "").read_text())
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("load_settings_or_exit", "run_service")
            and node.args
            and isinstance(node.args[0], ast.Name)
        ):
            continue
        prefix = DEFAULT_ENV_PREFIX
        for keyword in node.keywords:
            if keyword.arg != "env_prefix":
                continue
            if isinstance(keyword.value, ast.Constant):
                prefix = str(keyword.value.value)
            elif isinstance(keyword.value, ast.Name):
                prefix = str(getattr(module, keyword.value.id))
            else:
                raise ValueError(f"{target}: env_prefix is neither a constant nor a name")
        return getattr(module, node.args[0].id), prefix
    raise ValueError(f"{target} does not load its settings with load_settings_or_exit or run_service")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(kind: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(
        kind, "list" if "list" in str(kind) else str(kind)
    )


def _default(value: Any, kind: Any) -> str:
    if kind is bool:
        return f"`{str(value).lower()}`"
    if value == "" or value == []:
        return "(empty)"
    if isinstance(value, list):
        return f"`{','.join(str(v) for v in value)}`"
    return f"`{value}`"


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def render_settings(program: ProgramDoc) -> str:
    cls, prefix = settings_of_entry_point(program.target)
    hints = get_type_hints(cls)
    lines = [
        f"### {program.title}: `{program.command}`",
        "",
        f"Settings class `{cls.__module__}.{cls.__qualname__}`; environment prefix `{prefix}`. "
        "A flag beats the environment, which beats the default.",
        "",
        "| flag | environment | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        meta = field.metadata
        default = _field_default(field)
        meaning = str(meta.get("help", "")).strip()
        if meaning and not meaning.endswith((".", ")")):
            meaning += "."
        if meta.get("choices"):
            meaning += " One of " + ", ".join(f"`{c}`" for c in meta["choices"]) + "."
        if meta.get("secret"):
            meaning += " Secret: never logged (prefer the environment variable)."
        flag = "--" + field.name.replace("_", "-")
        env = prefix + field.name.upper()
        kind = hints[field.name]
        lines.append(
            f"| `{flag}` | `{env}` | {_type_name(kind)} | {_cell(_default(default, kind))} | {_cell(meaning)} |"
        )
    return "\n".join(lines)


class _NothingRunning:
    """What a scrape-time collector reads (a supervisor's runners), with nothing running: the
    families it yields still carry their names, types, labels and help."""

    def runners(self) -> list[Any]:
        return []


def _is_collector(source: Any) -> bool:
    """A Collector class (prometheus' Collector is a protocol: no issubclass)."""
    return isinstance(source, type) and callable(getattr(source, "collect", None))


def metric_families(program: ProgramDoc) -> list[Metric]:
    """The metric families ``program`` serves on /metrics (for a collector: with no samples)."""
    source = _load(program.metrics)
    if _is_collector(source):
        return list(source(_NothingRunning()).collect())
    return list(source().registry.collect())


def _metric_rows(program: ProgramDoc) -> list[tuple[str, str, str, str]]:
    rows = []
    metrics = _load(program.metrics)
    if _is_collector(metrics):
        for family in metric_families(program):
            shown = f"{family.name}_total" if family.type == "counter" else family.name
            labels = ", ".join(f"`{label}`" for label in getattr(family, "_labelnames", ()))
            rows.append((shown, family.type, labels, family.documentation))
        return sorted(rows)
    for value in vars(metrics()).values():
        name = getattr(value, "_name", None)
        kind = getattr(value, "_type", None)
        if not isinstance(name, str) or not isinstance(kind, str):
            continue  # not a prometheus_client metric (the registry itself, ...)
        shown = f"{name}_total" if kind == "counter" else name
        labels = ", ".join(f"`{label}`" for label in getattr(value, "_labelnames", ()))
        rows.append((shown, kind, labels, str(getattr(value, "_documentation", ""))))
    return sorted(rows)


def render_metrics(program: ProgramDoc) -> str:
    lines = [
        f"### {program.title}",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, kind, labels, doc in _metric_rows(program):
        lines.append(f"| `{name}` | {kind} | {labels or '-'} | {_cell(doc)} |")
    return "\n".join(lines)


def generated_sections() -> dict[str, str]:
    return {
        "settings": "\n\n".join(render_settings(p) for p in PROGRAMS),
        "metrics": "\n\n".join(render_metrics(p) for p in PROGRAMS),
    }


def _marker(kind: str, name: str) -> str:
    return f"<!-- {kind} GENERATED: {name} (python -m tools.gen_settings_docs) -->"


def update(text: str, sections: dict[str, str]) -> str:
    """`text` with each generated section replaced; ValueError if a section's markers are missing."""
    for name, body in sections.items():
        begin, end = _marker("BEGIN", name), _marker("END", name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"the doc has no {begin} ... {end} section")
        start, stop = found.span()
        text = f"{text[:start]}{begin}\n{body}\n{end}{text[stop:]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gen_settings_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the doc is current")
    parser.add_argument(
        "--doc", type=Path, default=DOC, help="the doc to update (default docs/operations.md)"
    )
    args = parser.parse_args(argv)
    current = args.doc.read_text()
    try:
        wanted = update(current, generated_sections())
    except ValueError as exc:
        print(f"gen_settings_docs: {exc}", file=sys.stderr)
        return 1
    if wanted == current:
        return 0
    if args.check:
        print(
            f"gen_settings_docs: {args.doc} is not current; run `python -m tools.gen_settings_docs`",
            file=sys.stderr,
        )
        return 1
    write_atomic(args.doc, wanted.encode())
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
