"""The node's ResourceSlice (resource.k8s.io/v1) and clique label, as objects and as API calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from services.nodeagent.wire.resourceslice import (
    CLIQUE_LABEL,
    ResourceSlicePublisher,
    ResourceSliceSettings,
    build_resource_slice,
    clique_label_patch,
    live_slice_content,
    resource_slice_name,
    slice_content,
)

CLIQUE = "5d9c6c0e-7f43-5a55-9c39-0a3f3c3f4e21.12345"


def test_slice_has_the_exact_v1_shape() -> None:
    body = build_resource_slice("rack0-tray3", CLIQUE, generation=4, node_uid="uid-1")
    assert body == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": "rack0-tray3-compute-domain.nvidia.com",
            "labels": {"app.kubernetes.io/managed-by": "compute-domain-node-agent"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": "rack0-tray3",
                    "uid": "uid-1",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "driver": "compute-domain.nvidia.com",
            "nodeName": "rack0-tray3",
            "pool": {"name": "rack0-tray3", "generation": 4, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "channel-0",
                    "attributes": {
                        "type": {"string": "channel"},
                        "id": {"int": 0},
                        "cliqueID": {"string": CLIQUE},
                    },
                }
            ],
        },
    }


async def test_slice_survives_the_typed_v1_model_unchanged() -> None:
    """Every field name is one resource.k8s.io/v1 knows: the generated model drops unknown ones."""
    async with ApiClient(Configuration()) as api:
        body = build_resource_slice("rack0-tray3", CLIQUE, generation=2, node_uid="u", resource_version="77")
        typed = api._ApiClient__deserialize(body, "V1ResourceSlice")
        assert api.sanitize_for_serialization(typed) == body
        assert typed.spec.devices[0].attributes["cliqueID"].string == CLIQUE
        assert typed.spec.devices[0].attributes["id"].int == 0


def test_live_content_matches_what_we_built_after_a_round_trip() -> None:
    body = build_resource_slice("n1", CLIQUE)
    # The apiserver echoes the object with server fields and null-valued attribute kinds.
    echoed = json.loads(json.dumps(body))
    echoed["metadata"]["resourceVersion"] = "12"
    echoed["spec"]["devices"][0]["attributes"]["id"].update({"string": None, "bool": None})
    assert live_slice_content(echoed) == slice_content("n1", CLIQUE)
    assert live_slice_content(echoed) != slice_content("n1", "other.1")


def test_long_node_names_still_give_a_valid_name() -> None:
    node = "n" * 250
    name = resource_slice_name(node)
    assert len(name) <= 253 and name.endswith(DRIVER_NAME)
    assert name != resource_slice_name("n" * 249 + "m")


def test_clique_label_patch_sets_or_removes_the_label() -> None:
    assert clique_label_patch(CLIQUE) == {"metadata": {"labels": {CLIQUE_LABEL: CLIQUE}}}
    assert clique_label_patch("") == {"metadata": {"labels": {CLIQUE_LABEL: None}}}


# ------------------------------------------------------------------ the publisher's API calls


class RecordingApiServer:
    """The few resource.k8s.io/v1 and core/v1 endpoints the publisher uses, recording calls.

    Not a Kubernetes: it checks resourceVersion on replace like the apiserver does, so the
    publisher's read-modify-write is exercised; real-apiserver coverage is in the e2e suite.
    """

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.node_labels: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.version = 0
        self.conflict_next_replace = False
        self.watchers: list[asyncio.Queue[dict[str, Any]]] = []
        # The resourceVersion each watch started from ("" = now, with the current state first).
        self.watch_starts: list[str] = []
        # A watch from a resourceVersion below this is refused as too old (410 Gone).
        self.oldest_version = 0

    def app(self) -> web.Application:
        base = "/apis/resource.k8s.io/v1/resourceslices"
        app = web.Application()
        app.router.add_get(base + "/{name}", self.read)
        app.router.add_get(base, self.watch)
        app.router.add_post(base, self.create)
        app.router.add_put(base + "/{name}", self.replace)
        app.router.add_delete(base + "/{name}", self.delete)
        app.router.add_get("/api/v1/nodes/{name}", self.read_node)
        # API discovery: the publisher asks which resource.k8s.io version is served first.
        app.router.add_get("/apis/resource.k8s.io", self.discovery)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        return app

    async def discovery(self, request: web.Request) -> web.Response:
        return web.json_response({"kind": "APIGroup", "versions": [{"version": "v1"}]})

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def _notify(self, change: str, obj: dict[str, Any]) -> None:
        for queue in self.watchers:
            queue.put_nowait({"type": change, "object": obj})

    async def watch(self, request: web.Request) -> web.StreamResponse:
        """A watch (only): ADDED for each matching slice, then every change, as JSON lines."""
        assert request.query.get("watch") in ("true", "True"), request.query
        selector = request.query.get("fieldSelector", "")
        name = selector.removeprefix("metadata.name=") if selector.startswith("metadata.name=") else None
        self.calls.append(("WATCH", name or ""))
        since = request.query.get("resourceVersion", "")
        self.watch_starts.append(since)
        response = web.StreamResponse()
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if since and int(since) < self.oldest_version:
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
            await response.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
            return response
        if not since:  # from now: the current state first, as ADDED events
            for obj in self.slices.values():
                queue.put_nowait({"type": "ADDED", "object": obj})
        self.watchers.append(queue)
        try:
            while True:
                event = await queue.get()
                if not event:
                    break  # the server stops
                if name is None or event["type"] == "BOOKMARK" or event["object"]["metadata"]["name"] == name:
                    await response.write((json.dumps(event) + "\n").encode())
        finally:
            self.watchers.remove(queue)
        await response.write_eof()
        return response

    def bookmark(self) -> None:
        """What the apiserver sends a watch that asked for bookmarks: the current resourceVersion."""
        mark = {"kind": "ResourceSlice", "metadata": {"name": "", "resourceVersion": str(self.version)}}
        for queue in self.watchers:
            queue.put_nowait({"type": "BOOKMARK", "object": mark})

    def close_watches(self) -> None:
        for queue in self.watchers:
            queue.put_nowait({})

    def wipe(self) -> None:
        """What kubelet does when it starts: delete every slice of the node."""
        for obj in list(self.slices.values()):
            del self.slices[obj["metadata"]["name"]]
            self._notify("DELETED", obj)

    async def read(self, request: web.Request) -> web.Response:
        self.calls.append(("GET", request.match_info["name"]))
        obj = self.slices.get(request.match_info["name"])
        if obj is None:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return web.json_response(obj)

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("POST", body["metadata"]["name"]))
        if body["metadata"]["name"] in self.slices:
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        self.slices[body["metadata"]["name"]] = self._bump(body)
        self._notify("ADDED", body)
        return web.json_response(body, status=201)

    async def replace(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await request.json()
        self.calls.append(("PUT", name))
        current = self.slices.get(name)
        if current is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if self.conflict_next_replace:
            self.conflict_next_replace = False
            self._bump(current)  # someone else wrote in between
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response({"kind": "Status", "code": 409, "reason": "Conflict"}, status=409)
        self.slices[name] = self._bump(body)
        self._notify("MODIFIED", body)
        return web.json_response(body)

    async def delete(self, request: web.Request) -> web.Response:
        self.calls.append(("DELETE", request.match_info["name"]))
        obj = self.slices.pop(request.match_info["name"], None)
        if obj is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        self._notify("DELETED", obj)
        return web.json_response(obj)  # the apiserver answers a delete with the object

    async def read_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.json_response(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": f"uid-of-{name}"}}
        )

    async def patch_node(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/strategic-merge-patch+json"
        patch = await request.json()
        self.calls.append(("PATCH", request.match_info["name"]))
        for key, value in patch["metadata"]["labels"].items():
            if value is None:
                self.node_labels.pop(key, None)
            else:
                self.node_labels[key] = value
        return web.json_response({"metadata": {"name": request.match_info["name"]}})


@pytest.fixture
async def apiserver() -> AsyncIterator[tuple[RecordingApiServer, ApiClient]]:
    server = RecordingApiServer()
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = Configuration(host=f"http://127.0.0.1:{port}")
    api = ApiClient(config)
    try:
        yield server, api
    finally:
        await api.close()
        server.close_watches()
        await runner.cleanup()


def _node(clique: str, message: str = "") -> pb.Node:
    return pb.Node(name="rack0-tray3", clique_id=clique, fabric_message=message)


async def test_publisher_creates_updates_and_labels(apiserver: tuple[RecordingApiServer, ApiClient]) -> None:
    server, api = apiserver
    publisher = ResourceSlicePublisher(api, "rack0-tray3", ResourceSliceSettings(publish_clique_label=True))
    name = "rack0-tray3-compute-domain.nvidia.com"

    await publisher.sync(CLIQUE)
    created = server.slices[name]
    assert created["spec"]["pool"] == {"name": "rack0-tray3", "generation": 1, "resourceSliceCount": 1}
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-of-rack0-tray3"
    assert server.node_labels == {CLIQUE_LABEL: CLIQUE}

    # Same clique again: nothing is written.
    writes = [c for c in server.calls if c[0] != "GET"]
    await publisher.sync(CLIQUE)
    assert [c for c in server.calls if c[0] != "GET"] == writes

    # A restarted agent finds its slice up to date: reads, writes nothing.
    fresh = ResourceSlicePublisher(api, "rack0-tray3", ResourceSliceSettings())
    await fresh.sync(CLIQUE)
    assert [c for c in server.calls if c[0] != "GET"] == writes

    # The clique changes (and a concurrent writer forces one retry): the pool generation moves on.
    server.conflict_next_replace = True
    await publisher.sync("5d9c6c0e-7f43-5a55-9c39-0a3f3c3f4e21.999")
    updated = server.slices[name]
    assert updated["spec"]["devices"][0]["attributes"]["cliqueID"] == {
        "string": "5d9c6c0e-7f43-5a55-9c39-0a3f3c3f4e21.999"
    }
    assert updated["spec"]["pool"]["generation"] == 2
    assert updated["metadata"]["ownerReferences"][0]["uid"] == "uid-of-rack0-tray3"
    assert [c[0] for c in server.calls].count("PUT") == 2  # the conflicted attempt and the retry

    # Non-fabric: the label goes away, the slice stays with an empty clique.
    await publisher.sync("")
    assert CLIQUE_LABEL not in server.node_labels
    assert server.slices[name]["spec"]["devices"][0]["attributes"]["cliqueID"] == {"string": ""}

    await publisher.delete()
    assert server.slices == {}
    await publisher.delete()  # already gone: not an error


async def test_publisher_follows_the_node_record_and_waits_for_a_settled_clique(
    apiserver: tuple[RecordingApiServer, ApiClient],
) -> None:
    server, api = apiserver
    records: asyncio.Queue[pb.Node] = asyncio.Queue()

    async def nodes() -> AsyncIterator[pb.Node]:
        while True:
            yield await records.get()

    publisher = ResourceSlicePublisher(api, "rack0-tray3", ResourceSliceSettings(delete_on_shutdown=True))
    task = asyncio.create_task(publisher.run(nodes()))
    try:
        await records.put(_node("", "clique Pending: fabric not ready: GPU 1 is IN_PROGRESS"))
        await asyncio.sleep(0.2)
        assert server.slices == {}, "no slice while the clique is not known"
        await records.put(_node(CLIQUE))
        for _ in range(100):
            if server.slices:
                break
            await asyncio.sleep(0.02)
        [slice_] = server.slices.values()
        assert slice_["spec"]["devices"][0]["attributes"]["cliqueID"] == {"string": CLIQUE}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert server.slices == {}, "deleted on shutdown when configured"


async def test_a_slice_deleted_or_changed_by_someone_else_is_published_again(
    apiserver: tuple[RecordingApiServer, ApiClient],
) -> None:
    """Kubelet deletes every ResourceSlice of its node when it starts: the running agent sees the
    deletion on its watch and publishes the slice again (else the node offers no channel until
    the agent restarts); a slice changed by another writer is put back the same way."""
    server, api = apiserver
    records: asyncio.Queue[pb.Node] = asyncio.Queue()

    async def nodes() -> AsyncIterator[pb.Node]:
        while True:
            yield await records.get()

    async def published(generation: int | None = None) -> dict[str, Any]:
        for _ in range(250):
            found = server.slices.get("rack0-tray3-compute-domain.nvidia.com")
            cliques = found and found["spec"]["devices"][0]["attributes"]["cliqueID"]
            if (
                found
                and cliques == {"string": CLIQUE}
                and generation in (None, found["spec"]["pool"]["generation"])
            ):
                return found
            await asyncio.sleep(0.02)
        raise AssertionError(f"slice not published again: {server.slices}")

    publisher = ResourceSlicePublisher(api, "rack0-tray3", ResourceSliceSettings())
    task = asyncio.create_task(publisher.run(nodes()))
    try:
        await records.put(_node(CLIQUE))
        await published()
        creates = [c for c in server.calls if c[0] == "POST"]
        assert len(creates) == 1
        server.wipe()
        await published()
        assert len([c for c in server.calls if c[0] == "POST"]) == 2
        # Another writer changes the device's clique: the agent's content comes back.
        current = server.slices["rack0-tray3-compute-domain.nvidia.com"]
        changed = json.loads(json.dumps(current))
        changed["spec"]["devices"][0]["attributes"]["cliqueID"] = {"string": "someone-else"}
        server.slices[changed["metadata"]["name"]] = server._bump(changed)
        server._notify("MODIFIED", changed)
        await published()
        # Its own writes do not make it write again.
        writes = len([c for c in server.calls if c[0] in ("POST", "PUT")])
        await asyncio.sleep(0.3)
        assert len([c for c in server.calls if c[0] in ("POST", "PUT")]) == writes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_watch_the_server_ends_resumes_without_reading_the_slice(
    apiserver: tuple[RecordingApiServer, ApiClient],
) -> None:
    """The apiserver ends every watch at its timeout (300 s): the publisher resumes at the last
    resourceVersion it saw (a bookmark's) and reads nothing, so a rack of idle agents costs the
    apiserver no GETs. A deletion seen on the resumed watch is still published again; a watch
    the server refuses as too old (410) starts afresh with one read."""
    server, api = apiserver
    records: asyncio.Queue[pb.Node] = asyncio.Queue()

    async def nodes() -> AsyncIterator[pb.Node]:
        while True:
            yield await records.get()

    def count(verb: str) -> int:
        return len([c for c in server.calls if c[0] == verb])

    async def until(check: Callable[[], bool], what: str) -> None:
        for _ in range(250):
            if check():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{what}: {server.calls} {server.watch_starts}")

    name = "rack0-tray3-compute-domain.nvidia.com"
    task = asyncio.create_task(
        ResourceSlicePublisher(api, "rack0-tray3", ResourceSliceSettings()).run(nodes())
    )
    try:
        # The first watch asks for a check of the slice before it opens; with the watch open
        # before the record arrives, that check and the record's publish are one read, so the
        # count below does not race a second one.
        await until(lambda: len(server.watchers) == 1, "no watch")
        await records.put(_node(CLIQUE))
        await until(lambda: name in server.slices, "not published")
        reads = count("GET")
        server.bookmark()
        await asyncio.sleep(0.1)
        for _ in range(3):  # the server's timeout, three times
            watches = count("WATCH")

            def reopened(before: int = watches) -> bool:
                return count("WATCH") == before + 1 and len(server.watchers) == 1

            server.close_watches()
            await until(reopened, "no new watch")
        assert server.watch_starts[-3:] == [str(server.version)] * 3
        assert count("GET") == reads, "a resumed watch read the slice"
        # Kubelet deletes the slice: the resumed watch sees it.
        server.wipe()
        await until(lambda: name in server.slices, "not published again after the deletion")
        # The server has compacted past the agent's resourceVersion: one fresh start.
        server.oldest_version = server.version + 1
        reads, watches = count("GET"), count("WATCH")
        server.close_watches()
        await until(lambda: count("WATCH") >= watches + 2 and len(server.watchers) == 1, "no fresh watch")
        assert server.watch_starts[-1] == ""
        await until(lambda: count("GET") == reads + 1, "the fresh watch did not check the slice")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
