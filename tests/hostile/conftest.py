"""Fixtures of the bad-input suite: one real advisor process per module, on the session's etcd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.state.config import EtcdConfig
from tests.conftest import unique_prefix
from tests.hostile.advisor_process import AdvisorProcess, start_advisor
from tools.etcd.server import EtcdServer


@pytest.fixture(scope="module")
def hostile_etcd_config(etcd: EtcdServer) -> EtcdConfig:
    return EtcdConfig(endpoint=etcd.endpoint, prefix=unique_prefix(), timeout_s=5.0)


@pytest.fixture(scope="module")
def advisor_process(
    hostile_etcd_config: EtcdConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdvisorProcess]:
    yield from start_advisor(hostile_etcd_config, tmp_path_factory.mktemp("advisor"))
