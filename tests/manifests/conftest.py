"""Rendered manifests, once per session: `kubectl kustomize` when a kubectl is found, else the
Python renderer (tests/manifests/kustomize.py); test_render.py checks that both agree."""

from __future__ import annotations

import pytest

from tests.manifests.kustomize import build
from tests.manifests.objects import TREES, Obj


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return {name: build(path) for name, path in TREES.items()}


@pytest.fixture(params=sorted(TREES))
def tree(request: pytest.FixtureRequest, rendered: dict[str, list[Obj]]) -> tuple[str, list[Obj]]:
    """Each kustomize tree (base and both overlays) as (name, objects)."""
    return request.param, rendered[request.param]


@pytest.fixture
def base(rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered["base"]


@pytest.fixture
def production(rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered["production"]


@pytest.fixture
def sim(rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered["sim"]
