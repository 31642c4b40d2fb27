"""`make demo`, the newcomer's first command, builds only what the demo runs: the services'
Python dependencies and etcd, side by side (`make -j2`), and none of what only the tests and lint
use (buf, helm, the Go placement client, the CDI checker, the control plane)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_ONLY_BUILDS = (
    "tools/buf/build.sh",
    "tools/helm/build.sh",
    "tools/cdi/build.sh",
    "integrations/placement-go/build.sh",
    "tools/controlplane/build.sh",
    "integrations/scheduler-plugin/build.sh",
    "tools/etcd/build-ctl.sh",
)


def dry_run(tmp_path: Path, *targets: str) -> list[str]:
    """The commands `make` would run on a fresh clone: the Makefile and the files its setup
    rules depend on, copied where no .venv exists."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "tools/setup.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", *targets],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return proc.stdout.splitlines()


def test_make_demo_builds_the_runtime_and_etcd_in_parallel_and_nothing_else(tmp_path: Path) -> None:
    commands = dry_run(tmp_path, "demo")
    assert "make --no-print-directory -j2 setup-demo" in commands
    assert any(c.startswith("bash tools/setup.sh --runtime") for c in commands)
    assert any(c.startswith("bash tools/etcd/build.sh") for c in commands)
    assert not [c for c in commands if any(build in c for build in TEST_ONLY_BUILDS)]
    assert commands[-1] == "PYTHON=.venv/bin/python bash tools/demo.sh"


def test_make_setup_still_builds_what_the_tests_use(tmp_path: Path) -> None:
    commands = "\n".join(dry_run(tmp_path, "setup"))
    for build in ("tools/buf/build.sh", "tools/helm/build.sh", "tools/etcd/build.sh"):
        assert build in commands
