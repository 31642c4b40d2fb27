"""Shared fixtures: a real etcd server (session-wide and per-test) and stores on it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.manifests.helm import helm_binary
from tests.skips import unexpected
from tools.cached_tool import BuildError
from tools.etcd.server import EtcdServer, etcd_binary


@pytest.fixture(scope="session")
def etcd_bin() -> Path:
    return etcd_binary()


@pytest.fixture(scope="session")
def etcd(etcd_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the whole session; tests isolate themselves with a key prefix."""
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd") / "data", binary=etcd_bin)
    server.start()
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary tools/helm/build.sh built (`make setup`)."""
    try:
        return helm_binary()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def private_etcd(etcd_bin: Path, tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that stop, restart or compact it."""
    server = EtcdServer(data_dir=tmp_path / "etcd-data", binary=etcd_bin)
    server.start()
    yield server
    server.destroy()


def unique_prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def etcd_config(etcd: EtcdServer) -> EtcdConfig:
    return EtcdConfig(endpoint=etcd.endpoint, prefix=unique_prefix(), timeout_s=5.0)


@pytest.fixture
async def store(etcd_config: EtcdConfig) -> AsyncIterator[Store]:
    s = Store(etcd_config)
    await s.connect()
    yield s
    await s.close()


_SKIPPED: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skip outside tests/skips.py fails the run: a skipped test proves nothing."""
    bad = unexpected(_SKIPPED)
    if not bad or session.config.getoption("collectonly"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", f"{len(bad)} skip(s) not in tests/skips.py", red=True)
        for nodeid, why in bad:
            reporter.write_line(f"SKIPPED {nodeid}: {why}")
    if exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
