"""The node agent's ResourceSlice watch on a real kube-apiserver: a watch the server ends at its
timeout resumes at the resourceVersion the publisher last saw (the server accepts it, else the
publisher would start afresh and read the slice), and a deletion is still seen after resuming.
The same with every server answer scripted, including 410 Gone: tests/nodeagent/test_resourceslice.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, CoreV1Api, ResourceV1Api

from libs.gen.computedomain.state import v1 as pb
from services.nodeagent.wire.resourceslice import ResourceSlicePublisher, ResourceSliceSettings
from tests.polling import eventually
from tools.controlplane.nodes import create_schedulable_node

pytestmark = pytest.mark.e2e

CLIQUE = "uuid-a.0"
WATCH_TIMEOUT_S = 1  # the server ends each watch after this: several resumes in a few seconds


async def test_the_slice_watch_resumes_without_reads_and_still_sees_a_deletion(k8s_api: ApiClient) -> None:
    node = f"node-{uuid.uuid4().hex[:8]}"
    await create_schedulable_node(CoreV1Api(k8s_api), node)
    publisher = ResourceSlicePublisher(
        k8s_api, node, ResourceSliceSettings(watch_timeout_s=WATCH_TIMEOUT_S, delete_on_shutdown=True)
    )
    reads = 0
    read_slice = publisher._read_slice

    async def counted(resource: Any) -> dict[str, Any] | None:
        nonlocal reads
        reads += 1
        return await read_slice(resource)

    publisher._read_slice = counted  # type: ignore[method-assign]

    async def records() -> AsyncIterator[pb.Node]:
        yield pb.Node(name=node, clique_id=CLIQUE)
        await asyncio.Event().wait()

    resource = ResourceV1Api(k8s_api)

    async def published() -> bool:
        try:
            await resource.read_resource_slice(publisher.name)
        except Exception:
            return False
        return True

    task = asyncio.create_task(publisher.run(records()))
    try:
        await eventually(published, "the slice published", 30.0)
        settled = reads
        await asyncio.sleep(WATCH_TIMEOUT_S * 5)  # several watches end and resume
        assert reads == settled, f"{reads - settled} reads of the slice while the watch resumed"
        # Kubelet deletes its node's slices when it starts: the resumed watch sees it.
        await resource.delete_resource_slice(publisher.name)
        await eventually(published, "the deleted slice published again", 30.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
