"""Fixtures for tests against a real Kubernetes control plane.

`control_plane` (session): etcd + kube-apiserver + kube-controller-manager +
kube-scheduler on loopback, built from the official Kubernetes modules on first
use (cached per user afterwards). `k8s_api` (function): a kubernetes_asyncio
ApiClient authenticated as cluster admin.

The build runs right after collection, outside any per-test timeout, and only
when a selected test uses `control_plane`. A failed build fails those tests with
the build's output; it never skips them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client import ApiClient

from tools.cached_tool import BuildError
from tools.controlplane.binaries import Binaries, ensure_binaries, supported_minors
from tools.controlplane.cluster import ControlPlane

_FIXTURES = ("control_plane", "control_plane_binaries")
_binaries: Binaries | None = None
_build_error: str | None = None


def _build() -> None:
    global _binaries, _build_error
    if _binaries is not None or _build_error is not None:
        return
    try:
        _binaries = ensure_binaries()
    except BuildError as exc:
        _build_error = str(exc)


def pytest_collection_finish(session: pytest.Session) -> None:
    fixtures = {f for item in session.items for f in getattr(item, "fixturenames", ())}
    if not fixtures & {*_FIXTURES, "oldest"}:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "control plane: building/locating Kubernetes binaries (cached after the first build)"
        )
    if fixtures & set(_FIXTURES):
        _build()
    if "oldest" in fixtures:
        # test_kubernetes_versions.py's oldest release, built here, outside any test's timeout; a
        # failure is reported by the fixture, which builds again.
        with contextlib.suppress(BuildError):
            ensure_binaries(minor=supported_minors()[-1])


@pytest.fixture(scope="session")
def control_plane_binaries() -> Binaries:
    """The built kube-* binaries and etcd (for tests that start a control plane of their own)."""
    _build()
    if _build_error is not None:
        pytest.fail(f"building the Kubernetes control plane failed:\n{_build_error}", pytrace=False)
    assert _binaries is not None
    return _binaries


@pytest.fixture(scope="session")
def control_plane(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A running control plane; attributes: server, kubeconfig, bin_dir, kubectl(), log_path()."""
    cp = ControlPlane(control_plane_binaries, tmp_path_factory.mktemp("controlplane"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@asynccontextmanager
async def admin_api(cp: ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin ApiClient for a control plane, closed on exit."""
    api = await k8s_config.new_client_from_config(config_file=str(cp.kubeconfig))
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def k8s_api(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin ApiClient for the session's control plane, closed after the test."""
    async with admin_api(control_plane) as api:
        yield api
