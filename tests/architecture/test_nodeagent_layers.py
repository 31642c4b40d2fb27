"""The node agent's layers (issue 30): core/ decides and does no async I/O, shell/ carries the
decisions out, wire/ speaks gRPC and Kubernetes. core/ imports neither shell/ nor wire/ nor an
async I/O library; shell/ does not import wire/ (the claim source port lives in core/claim.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.arch_figures import imported_modules, module_name, parse

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "services" / "nodeagent"
ASYNC_IO = ("asyncio", "aetcd", "aiohttp", "grpclib", "grpc", "kubernetes_asyncio")


def imports_of(layer: str) -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((AGENT / layer).glob("*.py")):
        for line, target in imported_modules(parse(path), module_name(REPO, path)):
            found.append((str(path.relative_to(REPO)), line, target))
    return found


def refused(found: list[tuple[str, int, str]], prefixes: tuple[str, ...]) -> list[str]:
    return [
        f"{path}:{line} imports {target}"
        for path, line, target in found
        if any(target == p or target.startswith(p + ".") for p in prefixes)
    ]


def test_the_layers_exist_and_main_and_settings_stay_at_the_top() -> None:
    for layer in ("core", "shell", "wire"):
        assert list((AGENT / layer).glob("*plan.py" if layer == "core" else "*.py"))
    assert (AGENT / "main.py").is_file() and (AGENT / "settings.py").is_file()


def test_core_imports_no_shell_no_wire_and_no_async_io() -> None:
    bad = refused(imports_of("core"), ("services.nodeagent.shell", "services.nodeagent.wire", *ASYNC_IO))
    assert not bad, "core/ must stay pure:\n" + "\n".join(bad)


def test_shell_imports_no_wire() -> None:
    bad = refused(imports_of("shell"), ("services.nodeagent.wire",))
    assert not bad, "shell/ reaches the wire only through ports in core/:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("line", "prefix"),
    [("import asyncio", "asyncio"), ("from ..shell.state import DeviceState", "services.nodeagent.shell")],
)
def test_a_forbidden_import_is_found(tmp_path: Path, line: str, prefix: str) -> None:
    path = tmp_path / "services" / "nodeagent" / "core" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(line + "\n")
    found = [(str(path), n, t) for n, t in imported_modules(parse(path), module_name(tmp_path, path))]
    assert refused(found, (prefix,))
