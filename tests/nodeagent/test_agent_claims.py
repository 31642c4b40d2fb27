"""Claim resolution (store and Kubernetes adapters) and strict decoding of the channel config."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from kubernetes_asyncio.client import ApiClient, Configuration

from libs.contract.channel_config import (
    ChannelConfig,
    ConfigError,
    decode_channel_config,
    parse_parameters_json,
)
from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.core.errors import ClaimGone, PermanentClaimError, RetryableClaimError
from services.nodeagent.wire.claim_source import (
    KubeClaimSource,
    StoreClaimSource,
    parse_resource_claim,
)
from tests.nodeagent.agent_fakes import channel_parameters, put_claim

CD_UID = "6f0e7b1c-1f6e-4a39-8a8e-3c1b2d4e5f60"
CLAIM_UID = "0d4c2b8e-5a77-4e7e-9a3e-1b2c3d4e5f61"

# A ResourceClaim as kube-apiserver v1.34+ returns it once the scheduler allocated it (generated
# from the workload template: request "channel", DeviceClass config first, then the claim's).
RESOURCE_CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {
        "name": "trainer-0-channel-x7k2p",
        "namespace": "team-a",
        "uid": CLAIM_UID,
        "resourceVersion": "48213",
        "generateName": "trainer-0-channel-",
        "annotations": {"resource.kubernetes.io/pod-claim-name": "channel"},
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Pod", "name": "trainer-0", "uid": "a1", "controller": True}
        ],
    },
    "spec": {
        "devices": {
            "requests": [
                {
                    "name": "channel",
                    "exactly": {
                        "deviceClassName": "compute-domain-default-channel.nvidia.com",
                        "allocationMode": "ExactCount",
                        "count": 1,
                    },
                }
            ],
            "config": [
                {
                    "requests": ["channel"],
                    "opaque": {
                        "driver": "compute-domain.nvidia.com",
                        "parameters": channel_parameters(CD_UID, "All"),
                    },
                }
            ],
        }
    },
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "channel",
                        "driver": "compute-domain.nvidia.com",
                        "pool": "rack0-tray3",
                        "device": "channel-0",
                    }
                ],
                "config": [
                    {
                        "source": "FromClass",
                        "opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}},
                    },
                    {
                        "source": "FromClass",
                        "opaque": {
                            "driver": "compute-domain.nvidia.com",
                            "parameters": channel_parameters("class-default"),
                        },
                    },
                    {
                        "source": "FromClaim",
                        "requests": ["channel"],
                        "opaque": {
                            "driver": "compute-domain.nvidia.com",
                            "parameters": channel_parameters(CD_UID, "All"),
                        },
                    },
                ],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["rack0-tray3"]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "a1"}],
    },
}
REF = ClaimRef("team-a", "trainer-0-channel-x7k2p", CLAIM_UID)


# ---- strict decoding -------------------------------------------------------------------------


def test_decode_valid_configs() -> None:
    assert decode_channel_config(channel_parameters("cd-1")) == ChannelConfig("cd-1", "Single")
    assert decode_channel_config(channel_parameters("cd-1", "All")) == ChannelConfig("cd-1", "All")
    params = channel_parameters("cd-1")
    del params["allocationMode"]
    assert decode_channel_config(params).allocation_mode == "Single"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "ComputeDomainDaemonConfig"}, 'field "kind" must be "ComputeDomainChannelConfig"'),
        ({"apiVersion": "resource.nvidia.com/v1"}, 'field "apiVersion" must be'),
        ({"domainID": ""}, 'field "domainID" must be a ComputeDomain UID'),
        ({"domainID": "a/b"}, 'field "domainID" must be a ComputeDomain UID'),
        ({"domainID": 7}, 'field "domainID" must be a string, got 7'),
        ({"allocationMode": "single"}, 'field "allocationMode" must be one of Single|All, got "single"'),
        ({"AllocationMode": "All"}, 'unknown field "AllocationMode"'),
    ],
)
def test_decode_rejects_with_the_field_named(change: dict[str, Any], message: str) -> None:
    params = {**channel_parameters("cd-1"), **change}
    with pytest.raises(ConfigError) as info:
        decode_channel_config(params)
    assert message in str(info.value)
    assert str(info.value).startswith("invalid opaque config for compute-domain.nvidia.com: ")


def test_missing_fields_and_wrong_shapes() -> None:
    with pytest.raises(ConfigError, match='missing required field "domainID"'):
        decode_channel_config(
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"}
        )
    with pytest.raises(ConfigError, match="must be an object"):
        decode_channel_config(["domainID"])
    with pytest.raises(ConfigError, match='duplicate field "kind"'):
        parse_parameters_json('{"kind": "a", "kind": "b"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_parameters_json('{"kind": ')


@given(
    st.text(min_size=1, max_size=20).filter(
        lambda s: s not in {"apiVersion", "kind", "domainID", "allocationMode"}
    )
)
def test_any_unknown_field_is_named(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_channel_config({**channel_parameters("cd-1"), name: True})
    assert f'unknown field "{name}"' in str(info.value)


# ---- the Kubernetes ResourceClaim ------------------------------------------------------------


def test_parse_allocated_resource_claim() -> None:
    claim = parse_resource_claim(RESOURCE_CLAIM, REF)
    assert claim.version == "48213"
    ours = claim.results_for("compute-domain.nvidia.com", "rack0-tray3")
    assert [(r.request, r.device) for r in ours] == [("channel", "channel-0")]
    assert claim.results_for("compute-domain.nvidia.com", "rack0-tray4") == ()
    # The claim's own config comes after the class default and wins.
    config = claim.config_for("compute-domain.nvidia.com", "channel")
    assert config is not None and config.source == "FromClaim"
    assert decode_channel_config(config.parameters) == ChannelConfig(CD_UID, "All")


def test_parse_subrequest_results_use_the_parent_requests_config() -> None:
    obj = copy.deepcopy(RESOURCE_CLAIM)
    obj["status"]["allocation"]["devices"]["results"][0]["request"] = "channel/nvl72"
    claim = parse_resource_claim(obj, REF)
    config = claim.config_for("compute-domain.nvidia.com", "channel/nvl72")
    assert config is not None and config.parameters["domainID"] == CD_UID


def test_parse_resource_claim_refusals() -> None:
    recreated = copy.deepcopy(RESOURCE_CLAIM)
    recreated["metadata"]["uid"] = "11111111-2222-4333-8444-555555555555"
    with pytest.raises(ClaimGone, match="deleted and re-created"):
        parse_resource_claim(recreated, REF)
    pending = copy.deepcopy(RESOURCE_CLAIM)
    del pending["status"]["allocation"]
    with pytest.raises(RetryableClaimError, match="not allocated"):
        parse_resource_claim(pending, REF)
    with pytest.raises(PermanentClaimError, match="kubelet named it team-b"):
        parse_resource_claim(RESOURCE_CLAIM, ClaimRef("team-b", REF.name, REF.uid))


async def served_versions(request: web.Request) -> web.Response:
    return web.json_response({"kind": "APIGroup", "name": "resource.k8s.io", "versions": [{"version": "v1"}]})


@pytest.fixture
async def fake_apiserver() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An HTTP server answering GET .../resourceclaims/<name> like kube-apiserver."""
    state: dict[str, Any] = {"claims": {}, "status": 200, "requests": []}

    async def get_claim(request: web.Request) -> web.Response:
        state["requests"].append(request.path)
        if state["status"] != 200:
            return web.json_response({"kind": "Status", "code": state["status"]}, status=state["status"])
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in state["claims"]:
            return web.json_response({"kind": "Status", "reason": "NotFound", "code": 404}, status=404)
        return web.json_response(state["claims"][key])

    app = web.Application()
    app.router.add_get("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}", get_claim)
    # API discovery: the claim source asks which resource.k8s.io version is served first.
    app.router.add_get("/apis/resource.k8s.io", served_versions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", state
    await runner.cleanup()


async def test_kube_claim_source_over_http(fake_apiserver: tuple[str, dict[str, Any]]) -> None:
    url, state = fake_apiserver
    config = Configuration(host=url)
    async with ApiClient(config) as api:
        source = KubeClaimSource(api, timeout_s=2.0)
        state["claims"][("team-a", REF.name)] = RESOURCE_CLAIM
        claim = await source.resolve(REF)
        assert claim.version == "48213" and claim.results[0].pool == "rack0-tray3"
        assert state["requests"] == [f"/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/{REF.name}"]

        with pytest.raises(ClaimGone):
            await source.resolve(ClaimRef("team-a", "gone", "x"))
        state["status"] = 503
        with pytest.raises(RetryableClaimError, match="HTTP 503"):
            await source.resolve(REF)

    async with ApiClient(Configuration(host="http://127.0.0.1:1")) as api:
        with pytest.raises(RetryableClaimError, match="unreachable"):
            await KubeClaimSource(api, timeout_s=2.0).resolve(REF)


# ---- the store (simulation) ------------------------------------------------------------------


async def test_store_claim_source(store: Store) -> None:
    ref = await put_claim(store, "rack0-tray0", CD_UID, mode="All")
    source = StoreClaimSource(store)
    claim = await source.resolve(ref)
    got = await store.get(store.keys.claim(ref.uid), pb.Claim)
    assert got is not None and claim.version == str(got.mod_revision)
    config = claim.config_for("compute-domain.nvidia.com", "channel")
    assert config is not None and decode_channel_config(config.parameters) == ChannelConfig(CD_UID, "All")
    with pytest.raises(PermanentClaimError, match="kubelet named it team-a/other"):
        await source.resolve(ClaimRef(ref.namespace, "other", ref.uid))
    with pytest.raises(ClaimGone):
        await source.resolve(ClaimRef(ref.namespace, ref.name, "no-such-uid"))
    with pytest.raises(PermanentClaimError, match="invalid"):
        await source.resolve(ClaimRef(ref.namespace, ref.name, "bad/uid"))
