"""Figures of the code's arrangement that issue 30 asks to show before and after.

    python -m tools.arch_figures [ROOT]

Prints, read with `ast` from the repository at ROOT (default: the current folder):
the largest class in services, libs and tools (without libs/gen) by lines; the polling
helpers defined in tests (functions named `eventually`, `wait_for` or `wait_until`) and the
inline deadline loops outside them (a loop whose condition, or an `if` or `assert` directly
in its body, reads a deadline or a clock);
every import of one service by another (services/<a> importing services.<b>), every import of
a service from libs/, and every import of the rig (tools) from the product (libs/, services/).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POLLING_HELPER_NAMES = frozenset({"eventually", "wait_for", "wait_until"})
CLOCK_WORDS = ("deadline", "monotonic", "time.time", "loop.time", "loop().time")


@dataclass(frozen=True)
class CrossImport:
    path: str
    line: int
    importer: str
    imported: str


def python_files(root: Path, top: str, skip: tuple[str, ...] = ()) -> Iterator[Path]:
    for path in sorted((root / top).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not any(rel.startswith(prefix) for prefix in skip) and ".venv" not in path.parts:
            yield path


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_modules(tree: ast.Module, module: str) -> Iterator[tuple[int, str]]:
    """Every module the tree imports, with relative imports resolved against `module`."""
    package = module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                # `from services import nodeagent` names a service without a dotted module.
                yield node.lineno, f"{target}.{alias.name}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = [*parts[:-1], "__init__"]
    return ".".join(parts)


def cross_service_imports(root: Path) -> list[CrossImport]:
    found: set[CrossImport] = set()
    for path in python_files(root, "services"):
        rel = path.relative_to(root)
        if len(rel.parts) < 3:
            continue  # services/__init__.py belongs to no service
        importer = rel.parts[1]
        for line, target in imported_modules(parse(path), module_name(root, path)):
            parts = target.split(".")
            if len(parts) >= 2 and parts[0] == "services" and parts[1] != importer:
                found.add(CrossImport(rel.as_posix(), line, importer, parts[1]))
    return sorted(found, key=lambda c: (c.path, c.line, c.imported))


def library_service_imports(root: Path) -> list[CrossImport]:
    """Every import of a service from libs/ (a library serves the services, never the reverse)."""
    found: set[CrossImport] = set()
    for path in python_files(root, "libs", skip=("libs/gen",)):
        rel = path.relative_to(root)
        for line, target in imported_modules(parse(path), module_name(root, path)):
            parts = target.split(".")
            if len(parts) >= 2 and parts[0] == "services":
                found.add(CrossImport(rel.as_posix(), line, "libs", parts[1]))
    return sorted(found, key=lambda c: (c.path, c.line, c.imported))


def rig_imports(root: Path) -> list[CrossImport]:
    """Every static import of tools.* from libs/ or services/: the product reaches the rig only
    through its ports, which load a stand-in by name (libs/runtime/stand_ins.py)."""
    found: dict[tuple[str, int], CrossImport] = {}
    for top in ("libs", "services"):
        for path in python_files(root, top, skip=("libs/gen",)):
            rel = path.relative_to(root).as_posix()
            for line, target in imported_modules(parse(path), module_name(root, path)):
                seen = found.get((rel, line))
                # `from tools.sim import imex` yields tools.sim and tools.sim.imex: name the first.
                if target.split(".")[0] == "tools" and (seen is None or len(target) < len(seen.imported)):
                    found[rel, line] = CrossImport(rel, line, top, target)
    return sorted(found.values(), key=lambda c: (c.path, c.line))


def largest_classes(root: Path, count: int = 5) -> list[tuple[int, str]]:
    sizes: list[tuple[int, str]] = []
    for top in ("services", "libs", "tools"):
        for path in python_files(root, top, skip=("libs/gen",)):
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    rel = path.relative_to(root).as_posix()
                    sizes.append((lines, f"{rel}:{node.lineno} {node.name}"))
    return sorted(sizes, reverse=True)[:count]


def is_deadline_condition(source: str) -> bool:
    return any(word in source for word in CLOCK_WORDS)


def loop_tests(loop: ast.While | ast.For) -> Iterator[ast.expr]:
    """The loop's own condition and the tests of the `if` and `assert` directly in its body."""
    if isinstance(loop, ast.While):
        yield loop.test
    for statement in loop.body:
        if isinstance(statement, ast.If | ast.Assert):
            yield statement.test


def polling_in_tests(root: Path) -> tuple[list[str], list[str]]:
    helpers: list[str] = []
    loops: list[str] = []
    for path in python_files(root, "tests"):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        rel = path.relative_to(root).as_posix()
        inside_helpers: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in POLLING_HELPER_NAMES:
                helpers.append(f"{rel}:{node.lineno} {node.name}")
                inside_helpers.update(id(inner) for inner in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.While | ast.For) and id(node) not in inside_helpers:
                if any(
                    is_deadline_condition(ast.get_source_segment(text, test) or "")
                    for test in loop_tests(node)
                ):
                    loops.append(f"{rel}:{node.lineno}")
    return helpers, loops


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".").resolve()
    print("largest classes (lines):")
    for lines, where in largest_classes(root):
        print(f"  {lines:5d}  {where}")
    helpers, loops = polling_in_tests(root)
    loop_files = {loop.split(":")[0] for loop in loops}
    print(f"polling helpers in tests: {len(helpers)}")
    for helper in helpers:
        print(f"  {helper}")
    print(f"inline deadline loops in tests: {len(loops)} in {len(loop_files)} files")
    crossings = cross_service_imports(root)
    print(f"imports of one service by another: {len(crossings)}")
    for crossing in crossings:
        print(
            f"  {crossing.path}:{crossing.line} services.{crossing.importer} -> services.{crossing.imported}"
        )
    upward = library_service_imports(root)
    print(f"imports of a service from libs/: {len(upward)}")
    for crossing in upward:
        print(f"  {crossing.path}:{crossing.line} libs -> services.{crossing.imported}")
    rig = rig_imports(root)
    print(f"imports of the rig (tools) from libs/ or services/: {len(rig)}")
    for crossing in rig:
        print(f"  {crossing.path}:{crossing.line} {crossing.importer} -> {crossing.imported}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
