"""Fixtures of the end-to-end tests: one environment (control plane with the node lifecycle
controller, etcd, E2E_RACKS x E2E_TRAYS nodes each with the upstream kubelet on crisim, an IMEX
agent and a kubelet plugin, advisor with the scheduler extender, controller) for the whole session,
started on first use.

Why 2 racks of 4 trays and not 36 nodes: real kubelets are bounded by inotify instances, not by
memory or CPU. The kernel gives a user 128 (fs.inotify.max_user_instances, left as it is), each
kubelet holds 4 and each control plane 13 (tools.sim.kubelet.inotify, counted from /proc/*/fd), and
while this environment runs a module may start its own (kubelet_env: a control plane and 4
kubelets). 36 kubelets alone would need 144. Eight nodes hold 45 instances with the control
plane, 74 while kubelet_env runs, leaving more than 50 to other programs of the same user; two
cliques of 4 still take every Job of the tests (4 pods in one clique) and show the extender's
choice between cliques.

The Kubernetes binaries are built (or found in the cache) right after collection, outside any
per-test timeout; a failed build fails the tests that need it, it never skips them. Set
CD_E2E_KEEP=1 to keep the environment's directory (logs, node state) after the session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client import ApiClient, CoreV1Api, V1Namespace, V1ObjectMeta

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.e2e.harness import E2EEnvironment
from tools.cached_tool import BuildError
from tools.controlplane.binaries import Binaries, ensure_binaries, ensure_node_binaries, supported_minors
from tools.sim.kubelet.host_state import host_state

E2E_RACKS = 2
E2E_TRAYS = 4

_binaries: Binaries | None = None
_build_error: str | None = None
# The oldest supported Kubernetes minor's binaries (test_oldest_kubernetes.py), or why they failed.
_oldest: Binaries | str | None = None


def _build() -> None:
    global _binaries, _build_error
    if _binaries is not None or _build_error is not None:
        return
    try:
        _binaries = ensure_binaries()
        ensure_node_binaries()  # kubelet and crisim
    except BuildError as exc:
        _build_error = str(exc)


def newest_binaries() -> Binaries:
    """The newest supported minor's binaries (built on first use); fails the test naming the
    build's error."""
    _build()
    if _build_error is not None:
        pytest.fail(f"building the Kubernetes binaries failed:\n{_build_error}", pytrace=False)
    assert _binaries is not None
    return _binaries


def oldest_binaries() -> Binaries:
    """The control plane of the oldest supported minor (built on first use); fails the test naming
    the build's error."""
    global _oldest
    if _oldest is None:
        try:
            _oldest = ensure_binaries(minor=supported_minors()[-1])
            ensure_node_binaries(minor=supported_minors()[-1])
        except BuildError as exc:
            _oldest = str(exc)
    if isinstance(_oldest, str):
        pytest.fail(f"building the oldest Kubernetes control plane failed:\n{_oldest}", pytrace=False)
    return _oldest


def pytest_collection_finish(session: pytest.Session) -> None:
    fixtures = {f for item in session.items for f in getattr(item, "fixturenames", ())}
    if fixtures & {"e2e_env", "kubelet_env", "shim_env", "nvidia_env", "plugin_env"}:
        _build()
    if "oldest_env" in fixtures:
        try:
            oldest_binaries()
        except pytest.fail.Exception:
            pass  # the tests that need them fail with the build's error


@contextmanager
def running(env: E2EEnvironment) -> Iterator[E2EEnvironment]:
    """The environment started, and stopped afterwards (its directory kept with CD_E2E_KEEP=1)."""
    env.start()
    try:
        yield env
    finally:
        env.stop(keep_root=os.environ.get("CD_E2E_KEEP") == "1")


@pytest.fixture(scope="session")
def e2e_env() -> Iterator[E2EEnvironment]:
    """The running environment; see tests.e2e.harness."""
    # Upstream eviction timeouts: no test of the session evicts, and a kubelet slowed down by a
    # loaded machine must not cost the session's domains their pods.
    env = E2EEnvironment(newest_binaries(), racks=E2E_RACKS, trays=E2E_TRAYS, eviction_toleration_s=None)
    with running(env):
        yield env


@pytest.fixture(scope="module")
def shim_env() -> Iterator[E2EEnvironment]:
    """A small environment (one rack of three trays) whose nodes the kubelet shim plays, as in the
    256-node benchmark (tools/bench/k8s_env.py): for the shim's own tests and the differential test."""
    env = E2EEnvironment(newest_binaries(), racks=1, trays=3, kubelets="shim")
    with running(env):
        yield env


@pytest.fixture(scope="module")
def kubelet_env() -> Iterator[E2EEnvironment]:
    """A small environment (one rack of four trays) whose nodes run the upstream kubelet on crisim;
    after it stops, the host is as before (tools.sim.kubelet.host_state)."""
    before = host_state()
    env = E2EEnvironment(newest_binaries(), racks=1, trays=4, kubelets="real")
    with running(env):
        yield env
    assert host_state() == before, "the real kubelets left the host changed"


@asynccontextmanager
async def admin_api(env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    """An admin ApiClient for an environment's API server."""
    api = await k8s_config.new_client_from_config(config_file=str(env.cp.kubeconfig))
    try:
        yield api
    finally:
        await api.close()


@asynccontextmanager
async def services_store(env: E2EEnvironment) -> AsyncIterator[Store]:
    """The services' store (default prefix) on an environment's etcd."""
    store = Store(EtcdConfig(endpoint=env.etcd.endpoint, timeout_s=5.0))
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def fresh_namespace(api: ApiClient, prefix: str) -> AsyncIterator[str]:
    """A new namespace named `prefix`-<random>, deleted afterwards (without waiting)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    await CoreV1Api(api).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        await CoreV1Api(api).delete_namespace(name)


@pytest.fixture
async def api(e2e_env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    """An admin ApiClient for the environment's API server."""
    async with admin_api(e2e_env) as client:
        yield client


@pytest.fixture
async def e2e_store(e2e_env: E2EEnvironment) -> AsyncIterator[Store]:
    """The services' store (default prefix) on the environment's etcd."""
    async with services_store(e2e_env) as store:
        yield store


@pytest.fixture
async def namespace(api: ApiClient) -> AsyncIterator[str]:
    """A fresh namespace for the test."""
    async with fresh_namespace(api, "e2e") as name:
        yield name


@pytest.fixture
async def other_namespace(api: ApiClient) -> AsyncIterator[str]:
    """A second fresh namespace (another tenant)."""
    async with fresh_namespace(api, "tenant") as name:
        yield name
