"""Fixtures of the Kueue tests (`make kueue`; not part of `make test`, see pyproject.toml's
norecursedirs): the session's end-to-end environment with kube-scheduler on its default
configuration (no extender: only Kueue steers the placement), Kueue's manager beside it, and the
cluster-wide queue objects of integrations/kueue/queues.yaml.

Kueue's cold build takes minutes, so it runs right after collection, outside any per-test timeout
(`make kueue` has already built it); a failed build fails the tests, it never skips them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import E2EEnvironment
from tests.e2e.kueue.manager import KueueManager, kueue_build
from tests.e2e.kueue.queued_job import cluster_queue_objects
from tools.cached_tool import BuildError

# What NVIDIA's GPU Feature Discovery puts on a GPU node, and queues.yaml's flavor selects; the
# simulated nodes do not carry it, so the fixture sets it for the module.
GPU_PRESENT = "nvidia.com/gpu.present"
_build_error: str | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build_error
    if any("kueue" in getattr(item, "fixturenames", ()) for item in session.items):
        try:
            kueue_build()
        except BuildError as exc:
            _build_error = str(exc)


@pytest.fixture(scope="module")
def kueue(e2e_env: E2EEnvironment) -> Iterator[KueueManager]:
    """Kueue running against the environment's API server, its queues in place, kube-scheduler
    without the extender; the extender is back for the modules after."""
    if _build_error is not None:
        pytest.fail(f"building Kueue failed:\n{_build_error}", pytrace=False)
    manager = KueueManager(e2e_env.cp, e2e_env.root / "kueue", e2e_env.log("kueue"))
    e2e_env.cp.restart_scheduler(None)
    try:
        e2e_env.cp.kubectl("label", "nodes", "--all", "--overwrite", f"{GPU_PRESENT}=true")
        manager.start()
        manager.apply(cluster_queue_objects())
        yield manager
    finally:
        for obj in reversed(cluster_queue_objects()):
            e2e_env.cp.kubectl(
                "delete", f"{obj['kind'].lower()}.kueue.x-k8s.io", obj["metadata"]["name"], "--ignore-not-found",
                "--wait=false",
                check=False,
            )  # fmt: skip
        manager.stop()
        e2e_env.cp.kubectl("label", "nodes", "--all", f"{GPU_PRESENT}-", check=False)
        e2e_env.configure_scheduler()
