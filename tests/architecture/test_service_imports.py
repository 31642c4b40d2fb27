"""No service imports another: what two services share lives in libs/, and libs/ imports no
service (issue 30).

Every module under services/ is parsed with `ast`; an import of services.<b> from
services/<a>/ (absolute, relative, or `from services import <b>`) is a crossing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.arch_figures import cross_service_imports, library_service_imports

REPO = Path(__file__).resolve().parents[2]


def test_no_service_imports_another() -> None:
    crossings = cross_service_imports(REPO)
    assert not crossings, "services import each other; move what they share into libs/:\n" + "\n".join(
        f"  {c.path}:{c.line} services.{c.importer} imports services.{c.imported}" for c in crossings
    )


def test_no_library_imports_a_service() -> None:
    upward = library_service_imports(REPO)
    assert not upward, (
        "libs/ imports services; a library serves the services, never the reverse:\n"
        + "\n".join(f"  {c.path}:{c.line} imports services.{c.imported}" for c in upward)
    )


def test_a_library_importing_a_service_is_found(tmp_path: Path) -> None:
    (tmp_path / "libs" / "state").mkdir(parents=True)
    (tmp_path / "libs" / "state" / "watch.py").write_text("from services.beta.watch import Watcher\n")
    assert [(c.path, c.imported) for c in library_service_imports(tmp_path)] == [
        ("libs/state/watch.py", "beta")
    ]


@pytest.mark.parametrize(
    "line",
    [
        "from services.beta.watch import Watcher",
        "import services.beta.watch",
        "from services import beta",
        "from ..beta import watch",
        "from ..beta.watch import Watcher",
    ],
)
def test_a_crossing_is_found_in_every_import_form(tmp_path: Path, line: str) -> None:
    (tmp_path / "services" / "alpha").mkdir(parents=True)
    (tmp_path / "services" / "beta").mkdir()
    (tmp_path / "services" / "alpha" / "agent.py").write_text(f"{line}\n")
    (tmp_path / "services" / "beta" / "watch.py").write_text("class Watcher: ...\n")

    crossings = cross_service_imports(tmp_path)

    assert [(c.path, c.line, c.importer, c.imported) for c in crossings] == [
        ("services/alpha/agent.py", 1, "alpha", "beta")
    ]


def test_imports_within_a_service_and_from_libs_are_not_crossings(tmp_path: Path) -> None:
    (tmp_path / "services" / "alpha").mkdir(parents=True)
    (tmp_path / "services" / "alpha" / "agent.py").write_text(
        "from services.alpha.core import plan\nfrom .core import plan\nfrom libs.state.watch import PrefixWatcher\n"
    )

    assert cross_service_imports(tmp_path) == []
