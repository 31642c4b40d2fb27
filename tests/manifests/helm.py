"""Rendering deployments/helm/compute-domains with the real helm (tools/helm/build.sh, built by
`make setup`), into objects shaped like tests/manifests/kustomize.py's."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.manifests.objects import REPO_ROOT, Obj
from tools.cached_tool import cached_tool

CHART = REPO_ROOT / "deployments" / "helm" / "compute-domains"
RELEASE = "cd"
HELM_TIMEOUT_S = 60.0


def helm_binary() -> Path:
    """The cached helm; fails naming `make setup` when it is not built (it is never built here)."""
    return cached_tool("tools/helm/build.sh", "--cached-only")


class HelmError(RuntimeError):
    """helm refused to render (its stderr is the message)."""


def render(
    helm: Path, namespace: str, values: dict[str, Any] | None = None, work_dir: Path | None = None
) -> list[Obj]:
    """`helm template` of the chart (CRDs included) into `namespace` with `values` on top."""
    args = [str(helm), "template", RELEASE, str(CHART), "--namespace", namespace, "--include-crds"]
    if values:
        if work_dir is None:
            raise ValueError("values need a work_dir to write them to")
        values_file = work_dir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        args += ["--values", str(values_file)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=HELM_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        # Without helm's notes on the chart's symbolic links (files/ links to manifests/).
        raise HelmError(
            "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("level=INFO"))
        )
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]
