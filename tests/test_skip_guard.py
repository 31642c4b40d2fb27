"""The skip guard: a skip outside tests/skips.py fails `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.skips import ALLOWED_SKIPS, unexpected

REPO = Path(__file__).resolve().parents[1]


def test_only_listed_tests_may_skip() -> None:
    allowed = next(iter(ALLOWED_SKIPS))
    got = unexpected([(f"{allowed}[param]", "why"), ("tests/x.py::test_y", "no reason")])
    assert got == [("tests/x.py::test_y", "no reason")]


def test_every_allowed_skip_names_a_real_test_and_a_reason() -> None:
    for nodeid, why in ALLOWED_SKIPS.items():
        path, name = nodeid.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), nodeid
        assert len(why) > 20, nodeid


def test_an_unlisted_skip_fails_the_run(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\ndef test_probe():\n    pytest.skip('nothing here')\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(probe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 skip(s) not in tests/skips.py" in run.stdout
    assert "test_probe.py::test_probe: Skipped: nothing here" in run.stdout
