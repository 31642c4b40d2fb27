"""Simulated cluster description: deterministic, unique, lazily derived identities (spec §6)."""

from __future__ import annotations

import ipaddress
import json
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.hardware.clique import parse_clique_id
from libs.hardware.errors import UnknownNodeError
from tools.sim.hardware.cluster import ClusterDescription


@st.composite
def clusters(draw: st.DrawFn, max_racks: int = 40, max_trays: int = 40) -> ClusterDescription:
    trays = draw(st.integers(min_value=1, max_value=max_trays))
    return ClusterDescription(
        racks=draw(st.integers(min_value=1, max_value=max_racks)),
        trays_per_rack=trays,
        gpus_per_tray=draw(st.integers(min_value=1, max_value=8)),
        partitions_per_rack=draw(st.integers(min_value=1, max_value=trays)),
        seed=draw(st.text(min_size=1, max_size=8)),
        address_block=draw(st.integers(min_value=1, max_value=200)),
    )


def check_identities_unique_and_valid(cluster: ClusterDescription) -> None:
    names, addresses, gpu_uuids = set(), set(), set()
    for ordinal, node in enumerate(cluster.nodes()):
        assert node.ordinal == ordinal
        assert node.name == f"rack{node.rack}-tray{node.tray}"
        assert cluster.parse_node_name(node.name) == (node.rack, node.tray)
        addr = ipaddress.IPv4Address(node.address)
        assert addr.is_loopback and node.address != "127.0.0.1"
        assert 1 <= int(node.address.rsplit(".", 1)[1]) <= 254
        assert cluster.node_by_address(node.address) == node
        assert uuid.UUID(node.cluster_uuid).version == 5
        names.add(node.name)
        addresses.add(node.address)
        for gpu in cluster.node_gpus(node):
            assert gpu.uuid.startswith("GPU-")
            assert uuid.UUID(gpu.uuid.removeprefix("GPU-")).version == 5
            gpu_uuids.add(gpu.uuid)
    assert len(names) == len(addresses) == cluster.node_count
    assert len(gpu_uuids) == cluster.gpu_count


@settings(max_examples=40, deadline=None)
@given(clusters())
def test_names_addresses_and_gpu_uuids_are_unique(cluster: ClusterDescription) -> None:
    check_identities_unique_and_valid(cluster)


@settings(max_examples=3, deadline=None)
@given(st.integers(min_value=556, max_value=700), st.integers(min_value=1, max_value=3))
def test_ten_thousand_plus_nvl72_nodes_stay_unique(racks: int, partitions: int) -> None:
    """Over 10,000 nodes: addresses cross the 256-racks-per-octet boundary without collisions."""
    cluster = ClusterDescription(racks=racks, partitions_per_rack=partitions)
    assert cluster.node_count >= 10_000
    check_identities_unique_and_valid(cluster)


def test_rack_octets_roll_over_into_the_next_block() -> None:
    cluster = ClusterDescription(racks=300)
    assert cluster.node("rack0-tray0").address == "127.1.0.1"
    assert cluster.node("rack255-tray17").address == "127.1.255.18"
    assert cluster.node("rack256-tray0").address == "127.2.0.1"


@settings(max_examples=60, deadline=None)
@given(clusters(max_racks=3))
def test_partitions_are_contiguous_balanced_cliques(cluster: ClusterDescription) -> None:
    for rack in range(cluster.racks):
        trays_seen: list[int] = []
        clique_ids = []
        for partition in range(cluster.partitions_per_rack):
            trays = cluster.partition_trays(partition)
            assert len(trays) > 0
            trays_seen.extend(trays)
            clique_ids.append(cluster.clique_id(rack, partition))
            members = {cluster.node(name).clique for name in cluster.clique_nodes(rack, partition)}
            assert len(members) == 1  # every member reports the same clique
            (clique,) = members
            assert parse_clique_id(clique) == (cluster.rack_cluster_uuid(rack), clique_ids[-1])
            for tray in trays:
                assert cluster.partition_of_tray(tray) == partition
        assert trays_seen == list(range(cluster.trays_per_rack))  # contiguous, in order, complete
        sizes = [len(cluster.partition_trays(p)) for p in range(cluster.partitions_per_rack)]
        assert max(sizes) - min(sizes) <= 1
        assert len(set(clique_ids)) == cluster.partitions_per_rack
    assert len({cluster.rack_cluster_uuid(r) for r in range(cluster.racks)}) == cluster.racks


def test_default_is_one_nvl72_clique_per_rack() -> None:
    cluster = ClusterDescription(racks=2)
    assert cluster.node_count == 36 and cluster.gpu_count == 144 and cluster.clique_count == 2
    rack0 = {cluster.node(n).clique for n in cluster.clique_nodes(0, 0)}
    rack1 = {cluster.node(n).clique for n in cluster.clique_nodes(1, 0)}
    assert len(rack0) == len(rack1) == 1 and rack0 != rack1
    assert len(cluster.clique_nodes(0, 0)) == 18


@settings(max_examples=30, deadline=None)
@given(clusters(max_racks=5))
def test_json_round_trip_reproduces_the_same_cluster(cluster: ClusterDescription) -> None:
    again = ClusterDescription.from_json(cluster.to_json())
    assert again == cluster
    assert [n for n in again.nodes()] == [n for n in cluster.nodes()]


def test_seed_separates_clusters() -> None:
    a, b = ClusterDescription(racks=1, seed="a"), ClusterDescription(racks=1, seed="b")
    assert a.rack_cluster_uuid(0) != b.rack_cluster_uuid(0)
    assert a.gpu_uuid(0, 0, 0) != b.gpu_uuid(0, 0, 0)


def test_save_and_load_through_a_file(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=3, partitions_per_rack=2, seed="bench")
    path = tmp_path / "cluster.json"
    cluster.save(path)
    assert ClusterDescription.load(path) == cluster
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]  # no temp file left behind


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "green"}, "unknown field(s) in cluster description: colour"),
        ({"racks": "3"}, "'racks' must be int"),
        ({"kind": "Other"}, "not a cluster description"),
        ({"racks": 0}, "racks must be >= 1"),
        ({"partitions_per_rack": 19}, "partitions_per_rack must be in [1, trays_per_rack=18]"),
        ({"trays_per_rack": 255}, "trays_per_rack must be in [1, 254]"),
    ],
)
def test_bad_cluster_files_are_refused_with_the_reason(change: dict, message: str) -> None:
    doc = json.loads(ClusterDescription(racks=1).to_json())
    doc.update(change)
    with pytest.raises(ValueError) as info:
        ClusterDescription.from_json(json.dumps(doc))
    assert message in str(info.value)


def test_too_many_racks_for_the_address_space_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        ClusterDescription(racks=256 * 255 + 1)
    assert ClusterDescription(racks=256 * 255).node_count == 256 * 255 * 18  # nothing is materialized


@pytest.mark.parametrize("name", ["rack2-tray0", "rack0-tray18", "rack00-tray1", "rack-1-tray0", "node0", ""])
def test_names_outside_the_cluster_are_unknown(name: str) -> None:
    cluster = ClusterDescription(racks=2)
    with pytest.raises(UnknownNodeError):
        cluster.node(name)


@pytest.mark.parametrize("address", ["127.0.0.1", "127.1.2.1", "127.1.0.19", "127.1.0.0", "10.0.0.1", "x"])
def test_addresses_outside_the_cluster_are_unknown(address: str) -> None:
    cluster = ClusterDescription(racks=2)
    with pytest.raises(UnknownNodeError):
        cluster.node_by_address(address)


def test_nodes_run_a_current_driver_unless_the_description_names_another() -> None:
    cluster = ClusterDescription(
        racks=1, trays_per_rack=4, node_driver_versions=(("rack0-tray2", "570.133.20"),)
    )
    assert cluster.node_driver_version("rack0-tray0") == "580.95.05"
    assert cluster.node_driver_version("rack0-tray2") == "570.133.20"
    doc = json.loads(cluster.to_json())
    assert doc["node_driver_versions"] == {"rack0-tray2": "570.133.20"}
    assert ClusterDescription.from_json(cluster.to_json()) == cluster


@pytest.mark.parametrize(
    ("versions", "problem"),
    [
        ((("rack0-tray9", "570.133.20"),), "unknown node"),
        ((("rack0-tray1", "r570"),), "not a driver version"),
        ((("rack0-tray1", "570.1"), ("rack0-tray1", "570.2")), "names a node twice"),
    ],
)
def test_a_bad_per_node_driver_version_is_refused_with_the_reason(
    versions: tuple[tuple[str, str], ...], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        ClusterDescription(racks=1, trays_per_rack=4, node_driver_versions=versions)
