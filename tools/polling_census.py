"""Count the polling helpers, inline deadline loops and wall-clock waits in tests/ and tools/.

    python -m tools.polling_census [--list] [roots ...]

A polling helper is a function named eventually, wait_for, wait_until or poll_until (leading
underscores ignored). It "loops" when its body has a while or for loop of its own; otherwise it
is a wrapper (over tests/polling.py, say). An inline deadline loop is a while loop outside any
helper that reads the clock (time.monotonic(), time.time(), loop.time()) or a name assigned from
`clock() + ...` in the same function. A file waits on the wall clock when it calls time.sleep,
asyncio.sleep with a non-zero delay, or reads time.monotonic(), time.time() or loop.time().
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HELPER_NAMES = frozenset({"eventually", "wait_for", "wait_until", "poll_until"})
CLOCK_ATTRS = frozenset({"monotonic", "time", "perf_counter"})
COMMON = Path("tests/polling.py")


@dataclass
class Census:
    looping_helpers: list[str] = field(default_factory=list)
    wrappers: list[str] = field(default_factory=list)
    common: list[str] = field(default_factory=list)
    deadline_loops: list[str] = field(default_factory=list)
    wall_clock_test_files: list[str] = field(default_factory=list)


def _is_clock_call(node: ast.AST) -> bool:
    """time.monotonic(), monotonic(), time.time(), loop.time(), ...get_running_loop().time()."""
    if not isinstance(node, ast.Call) or node.args:
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCK_ATTRS
    return isinstance(func, ast.Name) and func.id in {"monotonic", "perf_counter"}


def _deadline_names(function: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, ast.Add)
            and _is_clock_call(node.value.left)
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _reads_clock(loop: ast.While, deadlines: set[str]) -> bool:
    for node in ast.walk(loop):
        if _is_clock_call(node) or (isinstance(node, ast.Name) and node.id in deadlines):
            return True
    return False


def _sleeps_on_wall_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return _is_clock_call(node)
    if func.attr == "sleep" and func.value.id == "time":
        return True
    if func.attr == "sleep" and func.value.id == "asyncio":
        first = node.args[0] if node.args else None
        return not (isinstance(first, ast.Constant) and first.value == 0)
    return _is_clock_call(node)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def survey(path: Path, rel: Path, census: Census) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    helpers: list[ast.AST] = []
    for function in _functions(tree):
        if function.name.lstrip("_") not in HELPER_NAMES:
            continue
        where = f"{rel}:{function.lineno} {function.name}"
        loops = any(isinstance(n, ast.While | ast.For | ast.AsyncFor) for n in ast.walk(function))
        if rel == COMMON:
            if not any(entry.endswith(f" {function.name}") for entry in census.common):
                census.common.append(where)  # once per name: eventually has @overload stubs
        elif loops:
            census.looping_helpers.append(where)
        else:
            census.wrappers.append(where)
        helpers.append(function)
    inside_helpers = {id(n) for h in helpers for n in ast.walk(h)}
    for function in _functions(tree):
        deadlines = _deadline_names(function)
        for node in function.body:
            for loop in ast.walk(node):
                if (
                    isinstance(loop, ast.While)
                    and id(loop) not in inside_helpers
                    and _reads_clock(loop, deadlines)
                ):
                    entry = f"{rel}:{loop.lineno}"
                    if entry not in census.deadline_loops:
                        census.deadline_loops.append(entry)
    if rel.parts[0] == "tests" and rel != COMMON and any(_sleeps_on_wall_clock(n) for n in ast.walk(tree)):
        census.wall_clock_test_files.append(str(rel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("roots", nargs="*", default=["tests", "tools"])
    parser.add_argument("--list", action="store_true", help="name every helper, loop and file")
    args = parser.parse_args(argv)
    census = Census()
    for root in args.roots:
        for path in sorted(Path(root).rglob("*.py")):
            if path.resolve() != Path(__file__).resolve():
                survey(path, path, census)
    loop_files = {entry.split(":")[0] for entry in census.deadline_loops}
    in_tests = [entry for entry in census.deadline_loops if entry.startswith("tests/")]
    test_loop_files = {entry.split(":")[0] for entry in in_tests}
    rows = [
        ("common helpers (tests/polling.py)", census.common),
        ("polling helpers with their own loop", census.looping_helpers),
        ("wrappers without a loop of their own", census.wrappers),
        (f"inline deadline loops (in {len(loop_files)} files)", census.deadline_loops),
        (f"  of them under tests/ (in {len(test_loop_files)} files)", in_tests),
        ("test files that wait on the wall clock", census.wall_clock_test_files),
    ]
    for title, entries in rows:
        print(f"{len(entries):4d}  {title}")
        if args.list and not title.startswith(" "):
            for entry in entries:
                print(f"        {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
