"""The control plane's own behaviour: failure reporting and scheduler reconfiguration."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.client import (
    ApiClient,
    CoreV1Api,
    V1Container,
    V1Namespace,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
)
from kubernetes_asyncio.client.exceptions import ApiException

from tests.polling import eventually
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import ControlPlane, ControlPlaneError
from tools.controlplane.nodes import create_schedulable_node

pytestmark = pytest.mark.e2e


def test_startup_failure_names_the_process_shows_its_log_and_stops_the_rest(
    control_plane_binaries: Binaries, tmp_path: Path
) -> None:
    cp = ControlPlane(control_plane_binaries, tmp_path, apiserver_args=["--no-such-flag"])

    with pytest.raises(ControlPlaneError) as failure:
        cp.start()

    message = str(failure.value)
    assert "kube-apiserver exited with code" in message
    assert "unknown flag: --no-such-flag" in message
    assert str(cp.log_path("kube-apiserver")) in message
    # etcd, which had started, was stopped again.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{cp.etcd_url}/health", timeout=2)


async def test_restart_scheduler_applies_a_new_config(
    control_plane: ControlPlane, k8s_api: ApiClient, tmp_path: Path
) -> None:
    core = CoreV1Api(k8s_api)
    run_id = uuid.uuid4().hex[:8]
    node, namespace = f"node-{run_id}", f"sched-{run_id}"
    config = control_plane.scheduler_config()
    config["profiles"] = [{"schedulerName": "default-scheduler"}, {"schedulerName": "second-scheduler"}]
    config_path = tmp_path / "scheduler.yaml"
    config_path.write_text(yaml.safe_dump(config))
    try:
        await asyncio.to_thread(control_plane.restart_scheduler, config_path)
        await core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
        await create_schedulable_node(core, node)
        pod = V1Pod(
            metadata=V1ObjectMeta(name="p"),
            spec=V1PodSpec(
                scheduler_name="second-scheduler",
                node_selector={"kubernetes.io/hostname": node},
                containers=[V1Container(name="main", image="registry.invalid/workload:1")],
            ),
        )
        await core.create_namespaced_pod(namespace, pod)

        async def bound_node() -> str | None:
            return (await core.read_namespaced_pod("p", namespace)).spec.node_name

        assert await eventually(bound_node, "the second-scheduler profile to bind the pod", 30) == node
    finally:
        await asyncio.to_thread(control_plane.restart_scheduler)
        for cleanup in (
            core.delete_namespaced_pod("p", namespace, grace_period_seconds=0),
            core.delete_namespace(namespace),
            core.delete_node(node),
        ):
            try:
                await cleanup
            except ApiException as exc:
                if exc.status != 404:
                    raise
