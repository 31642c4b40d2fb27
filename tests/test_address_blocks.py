"""tests/e2e's session-wide environment never takes a loopback block that a later module starts
its own cluster on: two clusters on one block fight over the nodes' fixed ports."""

from __future__ import annotations

import pytest

from tests import address_blocks
from tests.e2e import harness
from tools.sim.hardware.cluster import ClusterDescription


def test_the_e2e_environment_takes_no_fixed_block() -> None:
    candidates = set(harness.candidate_blocks())
    assert candidates, "no block is left for the e2e environment"
    assert not candidates & address_blocks.FIXED


def test_the_e2e_environment_tries_no_fixed_block_even_when_every_block_is_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried: list[int] = []

    def busy(cluster: ClusterDescription) -> bool:
        tried.append(cluster.address_block)
        return False

    monkeypatch.setattr(harness, "_address_block_free", busy)
    with pytest.raises(harness.EnvironmentError_, match="no free loopback address block"):
        harness.pick_cluster(racks=1, trays=2)
    assert sorted(tried) == harness.candidate_blocks()
    assert not set(tried) & address_blocks.FIXED
