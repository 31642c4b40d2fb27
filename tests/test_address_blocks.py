"""tests/e2e's session-wide environment never takes a loopback block that a later module starts
its own cluster on: two clusters on one block fight over the nodes' fixed ports."""

from __future__ import annotations

from tests import address_blocks
from tests.e2e import harness


def test_the_e2e_environment_takes_no_fixed_block() -> None:
    candidates = set(harness.candidate_blocks())
    assert candidates, "no block is left for the e2e environment"
    assert not candidates & address_blocks.FIXED
