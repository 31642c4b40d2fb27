from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.imex.simdomain import SimCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimCluster]:
    sim = SimCluster(tmp_path)
    yield sim
    sim.close()
