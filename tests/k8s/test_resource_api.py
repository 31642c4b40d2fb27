"""resource.k8s.io version discovery and the object shapes of each version (pure, and over HTTP).

The real API servers (1.37 serving v1, 1.32 serving v1beta1) are in test_kubernetes_versions.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from libs.kube.resource_api import (
    ResourceApiUnavailable,
    ServedVersion,
    api_version,
    choose_version,
    device_attributes,
    device_request,
    discover_version,
    request_device_class,
    resource_path,
    slice_device,
)
from services.controller.kube.resourceclaimtemplate import build_rct
from services.nodeagent.wire.resourceslice import build_resource_slice, live_slice_content, slice_content


def _group(*versions: str) -> dict[str, Any]:
    return {
        "kind": "APIGroup",
        "name": "resource.k8s.io",
        "versions": [{"groupVersion": f"resource.k8s.io/{v}", "version": v} for v in versions],
        "preferredVersion": {"version": versions[0]} if versions else {},
    }


@pytest.mark.parametrize(
    ("served", "chosen"),
    [
        (("v1", "v1beta2", "v1beta1"), "v1"),  # 1.34+ with the betas switched on
        (("v1",), "v1"),  # 1.34+ as shipped
        (("v1beta2", "v1beta1"), "v1beta2"),  # 1.33
        (("v1beta1", "v1alpha3"), "v1beta1"),  # 1.32 with the alpha API on too
        (("v1beta1",), "v1beta1"),  # 1.32
    ],
)
def test_the_most_preferred_served_version_is_chosen(served: tuple[str, ...], chosen: str) -> None:
    assert choose_version(_group(*served)) == chosen


def test_a_cluster_without_a_version_we_speak_is_refused_with_a_hint() -> None:
    with pytest.raises(ResourceApiUnavailable, match=r"\[v1alpha3\].*DynamicResourceAllocation"):
        choose_version(_group("v1alpha3"))
    with pytest.raises(ResourceApiUnavailable, match=r"\[none\]"):
        choose_version({"kind": "Status"})


def test_unknown_versions_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'v2' is not supported"):
        api_version("v2")
    with pytest.raises(ValueError, match="'v1alpha3' is not supported"):
        device_request("channel", "c", "v1alpha3")
    with pytest.raises(ValueError, match="is not supported"):
        ServedVersion(None, "v1beta3")


def test_paths() -> None:
    assert (
        resource_path("v1beta1", "resourceslices", name="n")
        == "/apis/resource.k8s.io/v1beta1/resourceslices/n"
    )
    assert (
        resource_path("v1", "resourceclaims", "team-a", "c")
        == "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c"
    )


def test_requests_nest_under_exactly_except_in_v1beta1() -> None:
    assert device_request("channel", "cls", "v1") == {
        "name": "channel",
        "exactly": {"deviceClassName": "cls"},
    }
    assert device_request("channel", "cls", "v1beta2") == device_request("channel", "cls", "v1")
    assert device_request("channel", "cls", "v1beta1") == {"name": "channel", "deviceClassName": "cls"}
    for version in ("v1", "v1beta2", "v1beta1"):
        assert request_device_class(device_request("channel", "cls", version)) == "cls"


def test_slice_devices_nest_attributes_under_basic_only_in_v1beta1() -> None:
    attrs = {"type": {"string": "channel"}}
    assert slice_device("channel-0", attrs, "v1") == {"name": "channel-0", "attributes": attrs}
    assert slice_device("channel-0", attrs, "v1beta1") == {
        "name": "channel-0",
        "basic": {"attributes": attrs},
    }
    for version in ("v1", "v1beta2", "v1beta1"):
        assert device_attributes(slice_device("channel-0", attrs, version)) == attrs


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
def test_the_node_slice_reads_back_the_same_in_every_version(version: str) -> None:
    obj = build_resource_slice("rack0-tray3", "uuid.0", 2, "node-uid", version=version)
    assert obj["apiVersion"] == f"resource.k8s.io/{version}"
    device = obj["spec"]["devices"][0]
    assert ("basic" in device) == (version == "v1beta1")
    assert live_slice_content(obj) == slice_content("rack0-tray3", "uuid.0")


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
def test_the_workload_template_in_every_version(version: str) -> None:
    rct = build_rct("cd-uid", "team-a", "channel-template", "Single", version)
    assert rct["apiVersion"] == f"resource.k8s.io/{version}"
    (request,) = rct["spec"]["spec"]["devices"]["requests"]
    assert request_device_class(request) == "compute-domain-default-channel.nvidia.com"
    assert ("exactly" in request) == (version != "v1beta1")
    (config,) = rct["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["parameters"]["domainID"] == "cd-uid"


# ---- discovery over HTTP --------------------------------------------------------------------


@pytest.fixture
async def discovery_server() -> AsyncIterator[tuple[dict[str, Any], ApiClient]]:
    """Serves GET /apis/resource.k8s.io as state says: a status code and the versions."""
    state: dict[str, Any] = {"status": 200, "versions": ("v1beta1",), "calls": 0}

    async def group(request: web.Request) -> web.Response:
        state["calls"] += 1
        if state["status"] != 200:
            return web.json_response({"kind": "Status", "code": state["status"]}, status=state["status"])
        return web.json_response(_group(*state["versions"]))

    app = web.Application()
    app.router.add_get("/apis/resource.k8s.io", group)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    api = ApiClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        yield state, api
    finally:
        await api.close()
        await runner.cleanup()


async def test_discovery_asks_once_and_remembers(discovery_server: tuple[dict[str, Any], ApiClient]) -> None:
    state, api = discovery_server
    served = ServedVersion(api)
    assert served.known == ""
    assert await served.get() == "v1beta1"
    assert await served.get() == "v1beta1"
    assert state["calls"] == 1 and served.known == "v1beta1"
    # A configured version is used as it is, without asking.
    assert await ServedVersion(api, "v1").get() == "v1"
    assert state["calls"] == 1


async def test_a_group_not_served_is_named_and_a_failure_is_not_remembered(
    discovery_server: tuple[dict[str, Any], ApiClient],
) -> None:
    state, api = discovery_server
    state["status"] = 404
    with pytest.raises(ResourceApiUnavailable, match=r"does not serve resource\.k8s\.io"):
        await discover_version(api, timeout_s=5.0)
    served = ServedVersion(api)
    with pytest.raises(ResourceApiUnavailable):
        await served.get()
    state["status"], state["versions"] = 200, ("v1", "v1beta2")
    assert await served.get() == "v1"
