"""The kube-scheduler extender with kube-scheduler's own JSON (Go field names), against a real etcd."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.cancellation import cancel_until_done
from libs.state.store import Store
from services.advisor.advisor import Advisor
from services.advisor.domain_placement import SIZE_ANNOTATION, DomainPlacer
from services.advisor.domain_sources import (
    CachedTemplateSource,
    StaticDomainSizes,
    StaticTemplateSource,
    StoreTemplateSource,
    domain_of_template_object,
)
from services.advisor.extender import Extender, build_extender_app
from services.advisor.fleet_feeds import start_feeds, wait_until
from services.advisor.fleet_index import FleetIndex
from services.advisor.reservation_ids import ExtenderIds
from tests.advisor.fleet import bind, cluster_records, put_nodes
from tools.sim.hardware.cluster import ClusterDescription

PAYLOADS = Path(__file__).parent / "payloads"
CLUSTER = ClusterDescription(racks=4, trays_per_rack=18, seed="extender-test")
DOMAIN = "6b1e3c55-0d7a-4f26-9c1e-52a8f0b3d7aa"
# The extender's reservation id key of these tests (replicas share one; see reservation_ids.py).
IDS = ExtenderIds(bytes(range(32)))


def pod_args(node_names: list[str], **changes: Any) -> dict[str, Any]:
    """ExtenderArgs as kube-scheduler sends them with nodeCacheCapable: true."""
    args = json.loads((PAYLOADS / "filter_nodecache.json").read_text())
    args["NodeNames"] = list(node_names)
    pod = args["Pod"]
    if "template" in changes:
        pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = changes["template"]
    if changes.get("no_claims"):
        del pod["spec"]["resourceClaims"]
        del pod["spec"]["containers"][0]["resources"]["claims"]
    if "size" in changes:
        pod["metadata"]["annotations"][SIZE_ANNOTATION] = str(changes["size"])
    if "name" in changes:
        pod["metadata"]["name"] = changes["name"]
    return args


def node_object(name: str, clique: str) -> dict[str, Any]:
    node = json.loads((PAYLOADS / "node.json").read_text())
    node["metadata"]["name"] = name
    node["metadata"]["labels"]["kubernetes.io/hostname"] = name
    node["metadata"]["labels"]["nvidia.com/gpu.clique"] = clique
    return node


@dataclass
class Env:
    client: TestClient
    store: Store
    fleet: FleetIndex
    records: list[pb.Node]
    sizes: StaticDomainSizes
    templates: StaticTemplateSource
    placer: DomainPlacer

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    def clique_of(self, name: str) -> str:
        return self.fleet.nodes[name].clique

    async def filter(self, args: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post("/filter", data=json.dumps(args))
        assert response.status == 200, await response.text()
        return await response.json()


@pytest.fixture
async def env(store: Store) -> AsyncIterator[Env]:
    records = cluster_records(CLUSTER)
    await put_nodes(store, records)
    fleet = FleetIndex()
    feeds = start_feeds(fleet, store)
    assert await wait_until(fleet, lambda: fleet.ready, 10.0)
    templates = StaticTemplateSource({("team-a", "trainer-channel"): DOMAIN})
    sizes = StaticDomainSizes({})
    placer = DomainPlacer(Advisor(fleet, store), ttl_s=60, ids=IDS)
    extender = Extender(placer, templates, sizes)
    client = TestClient(TestServer(build_extender_app(extender)))
    await client.start_server()
    try:
        yield Env(client, store, fleet, records, sizes, templates, placer)
    finally:
        await client.close()
        await cancel_until_done(feeds)
        assert all(f.done() for f in feeds)


async def test_pods_without_our_claims_pass_through_untouched(env: Env) -> None:
    for args in (
        pod_args(env.names, no_claims=True),
        pod_args(env.names, template="someone-elses-template"),
    ):
        result = await env.filter(args)
        assert result == {
            "Nodes": None,
            "NodeNames": env.names,
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        }
        response = await env.client.post("/prioritize", data=json.dumps(args))
        assert await response.json() == [{"Host": n, "Score": 0} for n in env.names]
    assert env.fleet.reservations == {}


async def test_first_pod_reserves_num_nodes_in_one_clique_and_later_pods_follow(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 4
    first = await env.filter(pod_args(env.names, name="trainer-worker-0"))
    allowed = first["NodeNames"]
    assert len(allowed) == 4 and len({env.clique_of(n) for n in allowed}) == 1
    assert first["Error"] == ""
    # Everything else is refused with a reason that names the domain; no preemption can change it.
    assert set(first["FailedAndUnresolvableNodes"]) == set(env.names) - set(allowed)
    assert all(DOMAIN in why for why in first["FailedAndUnresolvableNodes"].values())
    record = await env.store.get(env.store.keys.reservation(IDS.make(DOMAIN, 0)), pb.Reservation)
    assert record is not None and sorted(record.value.node_names) == sorted(allowed)
    assert record.value.domain_uid == DOMAIN

    # The second pod of the domain gets the same nodes; nothing new is reserved.
    second = await env.filter(pod_args(env.names, name="trainer-worker-1"))
    assert second["NodeNames"] == allowed
    assert len(env.fleet.domain_reservations(DOMAIN)) == 1

    # Prioritize: the domain's nodes first.
    response = await env.client.post("/prioritize", data=json.dumps(pod_args(env.names)))
    scores = {p["Host"]: p["Score"] for p in await response.json()}
    assert {n for n, s in scores.items() if s == 10} == set(allowed)
    assert all(0 <= s <= 10 for s in scores.values())


async def test_size_hint_annotation_when_num_nodes_is_unset(env: Env) -> None:
    result = await env.filter(pod_args(env.names, size=6))
    assert len(result["NodeNames"]) == 6
    assert len({env.clique_of(n) for n in result["NodeNames"]}) == 1


async def test_unknown_size_grows_one_node_at_a_time_inside_the_clique(env: Env) -> None:
    first = await env.filter(pod_args(env.names))
    assert len(first["NodeNames"]) == 1
    (node_a,) = first["NodeNames"]
    clique = env.clique_of(node_a)
    # The pod lands and its claim is prepared: the node joins the domain. It is full now,
    # so kube-scheduler's own filters no longer offer it.
    await bind(env.store, node_a, DOMAIN)
    assert await wait_until(env.fleet, lambda: node_a in env.fleet.bound, 2.0)
    candidates = [n for n in env.names if n != node_a]
    second = await env.filter(pod_args(candidates))
    assert len(second["NodeNames"]) == 1
    (node_b,) = second["NodeNames"]
    assert node_b != node_a and env.clique_of(node_b) == clique
    ids = sorted(r.id for r in env.fleet.domain_reservations(DOMAIN))
    assert ids == sorted([IDS.make(DOMAIN, 0), IDS.make(DOMAIN, 1)])


async def test_a_gang_whose_reservation_lapsed_before_all_its_pods_bound_stays_in_its_clique(
    env: Env,
) -> None:
    """kube-scheduler keeps an unschedulable pod queued for up to 5 minutes, as long as the
    reservation's TTL: the reservation made at a gang's first pod can lapse with some pods bound
    whose claims are not prepared yet (no node of the domain joined). Those pods hold nodes of the
    clique the advisor cannot see; the next pod must go to that clique too, not to a fresh
    placement of the whole gang elsewhere (the gang would be split over two cliques)."""
    env.sizes.mapping[DOMAIN] = 16
    first = await env.filter(pod_args(env.names, name="trainer-worker-0"))
    assert len(first["NodeNames"]) == 16
    (clique,) = {env.clique_of(n) for n in first["NodeNames"]}
    bound = first["NodeNames"][:4]  # four pods bound; kube-scheduler's DRA filter now skips them
    (reservation,) = env.fleet.domain_reservations(DOMAIN)
    released, _ = await env.placer.advisor.release(reservation.id, env.placer.holder)
    assert released and not env.fleet.domain_reservations(DOMAIN)
    # Its clique now has 14 free candidates, every other clique 18: a best fit of 16 nodes
    # would take another clique.
    candidates = [n for n in env.names if n not in bound]
    for worker in range(4, 16):
        result = await env.filter(pod_args(candidates, name=f"trainer-worker-{worker}"))
        assert len(result["NodeNames"]) == 1, result
        (node,) = result["NodeNames"]
        assert env.clique_of(node) == clique, (worker, node)
        candidates.remove(node)  # the pod is bound there
    held = {n for r in env.fleet.domain_reservations(DOMAIN) for n in r.node_names}
    assert len(held) == 12 and {env.clique_of(n) for n in held} == {clique}


async def test_a_gang_that_fits_a_whole_clique_is_not_split_while_node_records_lapse(env: Env) -> None:
    """Under load node agents' leases lapse and their records leave the store for a while: every
    clique then has fewer nodes on record than it has. A gang that fits a whole clique must wait
    for one, not be spread over several as if it were larger than any clique."""
    env.sizes.mapping[DOMAIN] = 16
    lapsed = [r.name for r in env.records if r.name.endswith(("-tray0", "-tray1", "-tray2"))]
    assert len(lapsed) == 12  # three of each clique's 18
    for name in lapsed:
        await env.store.delete(env.store.keys.node(name))
    assert await wait_until(env.fleet, lambda: not set(lapsed) & set(env.fleet.nodes), 5.0)
    assert env.fleet.largest_clique() == 15
    result = await env.filter(pod_args(env.names, name="trainer-worker-0"))
    assert result["NodeNames"] == [], result
    assert env.fleet.domain_reservations(DOMAIN) == []
    why = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert all("16 node(s)" in reason for reason in why.values()), why
    # The records come back: the gang lands in one clique.
    await put_nodes(env.store, [r for r in env.records if r.name in lapsed])
    assert await wait_until(env.fleet, lambda: set(lapsed) <= set(env.fleet.nodes), 5.0)
    placed = await env.filter(pod_args(env.names, name="trainer-worker-0"))
    assert len(placed["NodeNames"]) == 16 and len({env.clique_of(n) for n in placed["NodeNames"]}) == 1


async def test_domain_larger_than_a_clique_spans_few_cliques(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 36
    result = await env.filter(pod_args(env.names))
    assert len(result["NodeNames"]) == 36
    assert len({env.clique_of(n) for n in result["NodeNames"]}) == 2


async def test_reservation_respects_the_schedulers_candidates(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 3
    last_rack = [n for n in env.names if n.startswith("rack3-")]
    result = await env.filter(pod_args(last_rack))
    assert len(result["NodeNames"]) == 3 and all(n.startswith("rack3-") for n in result["NodeNames"])


async def test_a_domain_larger_than_the_schedulers_sample_is_placed_on_the_candidates_clique(
    env: Env,
) -> None:
    """kube-scheduler sends only the feasible nodes it found before it stopped looking
    (percentageOfNodesToScore); the rest of the clique was not refused."""
    env.sizes.mapping[DOMAIN] = 18
    sample = [f"rack2-tray{t}" for t in range(9)]
    result = await env.filter(pod_args(sample))
    assert sorted(result["NodeNames"]) == sorted(sample)
    (reservation,) = env.fleet.domain_reservations(DOMAIN)
    assert sorted(reservation.node_names) == sorted(f"rack2-tray{t}" for t in range(18))


async def test_a_domain_larger_than_the_candidates_cliques_is_placed_on_the_fabric(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 40
    sample = [f"rack1-tray{t}" for t in range(5)]
    result = await env.filter(pod_args(sample))
    assert sorted(result["NodeNames"]) == sorted(sample)
    (reservation,) = env.fleet.domain_reservations(DOMAIN)
    assert len(reservation.node_names) == 40 and set(sample) <= set(reservation.node_names)
    assert len({env.clique_of(n) for n in reservation.node_names}) == 3


async def test_no_room_in_any_clique_fails_the_nodes_with_the_reason(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 10
    for rack in range(4):  # leave 8 free per clique
        for tray in range(10):
            await bind(env.store, f"rack{rack}-tray{tray}", f"busy-{rack}")
    assert await wait_until(env.fleet, lambda: env.fleet.tally.free_count == 32, 3.0)
    result = await env.filter(pod_args(env.names))
    assert result["NodeNames"] == []
    assert set(result["FailedNodes"]) == set(env.names)
    assert "FRAGMENTED" in next(iter(result["FailedNodes"].values()))
    assert env.fleet.domain_reservations(DOMAIN) == []


async def test_node_objects_mode_returns_node_objects(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 2
    args = pod_args([])
    args["NodeNames"] = None
    args["Nodes"] = {
        "metadata": {"resourceVersion": "48220"},
        "items": [node_object(n, env.clique_of(n)) for n in env.names],
    }
    result = await env.filter(args)
    assert result["NodeNames"] is None
    kept = [item["metadata"]["name"] for item in result["Nodes"]["items"]]
    assert len(kept) == 2
    # Whole objects come back as they were sent.
    assert result["Nodes"]["items"][0] == node_object(kept[0], env.clique_of(kept[0]))


async def test_a_pod_not_ours_gets_every_node_object_back_unchanged(env: Env) -> None:
    """Kept Nodes are returned as the bytes they came as (not re-encoded): escapes and non-ASCII
    text in a label survive."""
    nodes = [node_object(n, env.clique_of(n)) for n in env.names[:4]]
    nodes[1]["metadata"]["labels"]["note"] = 'quote " and é and \\u2028 \u2028'
    args = pod_args([], no_claims=True)
    args["NodeNames"] = None
    args["Nodes"] = {"metadata": {}, "items": nodes}
    result = await env.filter(args)
    assert result["Nodes"]["items"] == nodes and result["FailedNodes"] == {}


async def test_go_style_case_insensitive_keys_are_accepted(env: Env) -> None:
    args = pod_args(env.names[:3], no_claims=True)
    lowered = {"pod": args["Pod"], "nodes": None, "nodenames": args["NodeNames"]}
    result = await env.filter(lowered)
    assert result["NodeNames"] == env.names[:3]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"Pod": 5, "NodeNames": []}).encode(), "Pod"),
        (json.dumps({"Pod": {"spec": {}}, "NodeNames": []}).encode(), "Pod.metadata"),
        (json.dumps({"Pod": {"metadata": {"name": "p"}}}).encode(), "NodeNames / Nodes"),
        (json.dumps({"Pod": {"metadata": {}}, "NodeNames": ["a", 7]}).encode(), "NodeNames[1]"),
        (json.dumps({"Pod": {"metadata": {}}, "Nodes": {"items": {}}}).encode(), "Nodes.items"),
        (
            json.dumps({"Pod": {"metadata": {}}, "Nodes": {"items": [{"metadata": {}}]}}).encode(),
            "Nodes.items[0]",
        ),
        (
            json.dumps({"Pod": {"metadata": {}, "spec": {"resourceClaims": "x"}}, "NodeNames": []}).encode(),
            "Pod.spec.resourceClaims",
        ),
    ],
)
async def test_malformed_requests_are_400_naming_the_problem(env: Env, body: bytes, named: str) -> None:
    for verb in ("/filter", "/prioritize"):
        response = await env.client.post(verb, data=body)
        assert response.status == 400
        assert named in await response.text()
    # Still serving.
    ok = await env.filter(pod_args(env.names[:2], no_claims=True))
    assert ok["NodeNames"] == env.names[:2]


async def test_bad_size_annotation_on_our_pod_is_400(env: Env) -> None:
    response = await env.client.post("/filter", data=json.dumps(pod_args(env.names, size="lots")))
    assert response.status == 400
    assert SIZE_ANNOTATION in await response.text()


async def test_prefix_and_verbs_are_configurable(env: Env) -> None:
    extender = Extender(DomainPlacer(Advisor(env.fleet, env.store)), env.templates, env.sizes)
    app = build_extender_app(
        extender, prefix="/scheduler/cd", filter_verb="predicates", prioritize_verb="priorities"
    )
    async with TestClient(TestServer(app)) as client:
        args = json.dumps(pod_args(env.names[:2], no_claims=True))
        assert (await client.post("/scheduler/cd/predicates", data=args)).status == 200
        assert (await client.post("/scheduler/cd/priorities", data=args)).status == 200
        assert (await client.post("/filter", data=args)).status == 404


def test_template_domain_comes_from_label_or_opaque_config() -> None:
    labelled = {"metadata": {"labels": {"resource.nvidia.com/computeDomain": "uid-1"}}}
    assert domain_of_template_object(labelled) == "uid-1"
    configured = {
        "metadata": {"name": "t"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "channel"}],
                    "config": [
                        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"domainID": "wrong"}}},
                        {
                            "requests": ["channel"],
                            "opaque": {
                                "driver": "compute-domain.nvidia.com",
                                "parameters": {
                                    "apiVersion": "resource.nvidia.com/v1beta1",
                                    "kind": "ComputeDomainChannelConfig",
                                    "domainID": "uid-2",
                                    "allocationMode": "Single",
                                },
                            },
                        },
                    ],
                }
            }
        },
    }
    assert domain_of_template_object(configured) == "uid-2"
    assert domain_of_template_object({"metadata": {}}) is None


async def test_template_lookups_are_cached() -> None:
    now = [0.0]
    inner = StaticTemplateSource({("ns", "t"): "uid"})
    cached = CachedTemplateSource(inner, ttl_s=10, negative_ttl_s=1, clock=lambda: now[0])
    assert await cached.domain_of_template("ns", "t") == "uid"
    assert await cached.domain_of_template("ns", "t") == "uid"
    assert await cached.domain_of_template("ns", "other") is None
    assert await cached.domain_of_template("ns", "other") is None
    assert inner.lookups == 2
    now[0] = 2.0
    await cached.domain_of_template("ns", "other")
    assert inner.lookups == 3
    now[0] = 11.0
    await cached.domain_of_template("ns", "t")
    assert inner.lookups == 4


async def test_store_template_source_reads_mirrored_domains(store: Store) -> None:
    domain = pb.ComputeDomain(
        uid="uid-9",
        namespace="team-b",
        name="cd",
        spec=pb.ComputeDomainSpec(
            num_nodes=2, channel=pb.ChannelSpec(resource_claim_template_name="cd-channel")
        ),
    )
    await store.put(store.keys.domain("uid-9"), domain)
    source = StoreTemplateSource(store, refresh_s=0.0, min_reload_s=0.0)
    assert await source.domain_of_template("team-b", "cd-channel") == "uid-9"
    assert await source.domain_of_template("team-a", "cd-channel") is None
    copy_of = copy.deepcopy(domain)
    copy_of.deleting = True
    await store.put(store.keys.domain("uid-9"), copy_of)
    await asyncio.sleep(0.01)
    assert await source.domain_of_template("team-b", "cd-channel") is None


async def test_nodes_without_a_fabric_are_not_refused(env: Env) -> None:
    env.sizes.mapping[DOMAIN] = 4
    plain = [f"cpu-node-{i}" for i in range(3)]
    for name in plain:
        await env.store.put(env.store.keys.node(name), pb.Node(name=name, health=pb.Health.HEALTHY))
    assert await wait_until(env.fleet, lambda: all(n in env.fleet.nodes for n in plain), 2.0)
    result = await env.filter(pod_args(plain))
    assert result["NodeNames"] == plain and result["FailedNodes"] == {}, result
    assert env.fleet.domain_reservations(DOMAIN) == []


async def test_nodes_the_inventory_does_not_know_are_refused_not_taken_for_plain_nodes(env: Env) -> None:
    # Records gone (lapsed leases): such nodes may well be in a clique, so a domain's pod must
    # not go there unplaced, or its domain ends up split over cliques.
    env.sizes.mapping[DOMAIN] = 4
    unknown = [f"vanished-{i}" for i in range(3)]
    plain = "cpu-node-0"
    await env.store.put(env.store.keys.node(plain), pb.Node(name=plain, health=pb.Health.HEALTHY))
    assert await wait_until(env.fleet, lambda: plain in env.fleet.nodes, 2.0)
    mixed = await env.filter(pod_args([plain, *unknown]))
    assert mixed["NodeNames"] == [plain], mixed
    assert sorted(mixed["FailedNodes"]) == unknown and "no node record" in mixed["FailedNodes"]["vanished-0"]
    result = await env.filter(pod_args(unknown))
    assert not result["NodeNames"], result
    refused = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert sorted(refused) == unknown, result


async def test_kube_template_source_reads_the_template_from_the_api_server() -> None:
    from aiohttp import web
    from kubernetes_asyncio import client as kube

    from services.advisor.domain_sources import KubeTemplateSource

    seen: list[str] = []

    async def template(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.match_info["name"] != "trainer-channel":
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return web.json_response(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {
                    "name": "trainer-channel",
                    "namespace": request.match_info["ns"],
                    "labels": {"resource.nvidia.com/computeDomain": DOMAIN},
                },
                "spec": {"spec": {"devices": {"requests": [{"name": "channel"}]}}},
            }
        )

    async def served_versions(request: web.Request) -> web.Response:
        return web.json_response({"kind": "APIGroup", "versions": [{"version": "v1"}]})

    app = web.Application()
    app.router.add_get("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates/{name}", template)
    # API discovery: the source asks which resource.k8s.io version is served first.
    app.router.add_get("/apis/resource.k8s.io", served_versions)
    async with TestServer(app) as server:
        configuration = kube.Configuration(host=str(server.make_url("")).rstrip("/"))
        async with kube.ApiClient(configuration) as api_client:
            source = KubeTemplateSource(api_client)
            assert await source.domain_of_template("team-a", "trainer-channel") == DOMAIN
            assert await source.domain_of_template("team-a", "other") is None
    assert seen == [
        "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaimtemplates/trainer-channel",
        "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaimtemplates/other",
    ]
