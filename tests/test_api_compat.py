"""buf over protos/: the lint rules and the breaking-change check against the released placement
API (protos/released/placement-v1.binpb) pass on the repo and catch what they are there for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tools.cached_tool import cached_tool

REPO = Path(__file__).resolve().parents[1]
API = "computedomain/placement/v1"


@pytest.fixture(scope="module")
def buf() -> Path:
    return cached_tool("tools/buf/build.sh", "--cached-only")


def run_buf(buf: Path, protos: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(buf), *args], cwd=protos, capture_output=True, text=True, timeout=120)


def breaking(buf: Path, protos: Path) -> subprocess.CompletedProcess[str]:
    against = REPO / "protos/released/placement-v1.binpb"
    return run_buf(buf, protos, "breaking", "--path", API, "--against", str(against))


@pytest.fixture
def protos_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "protos"
    shutil.copytree(REPO / "protos", copy)
    return copy


def edit(protos: Path, old: str, new: str) -> None:
    path = protos / API / "placement.proto"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_repo_protos_pass_lint_and_breaking(buf: Path) -> None:
    lint = run_buf(buf, REPO / "protos", "lint")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    check = breaking(buf, REPO / "protos")
    assert check.returncode == 0, check.stdout + check.stderr


def test_an_additive_change_is_not_breaking(buf: Path, protos_copy: Path) -> None:
    edit(
        protos_copy,
        "  repeated string candidate_nodes = 14;\n",
        "  repeated string candidate_nodes = 14;\n  string note = 15;\n",
    )
    check = breaking(buf, protos_copy)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(
    ("old", "new", "complaint"),
    [
        ("int32 num_nodes = 1;", "int64 num_nodes = 1;", 'changed type from "int32" to "int64"'),
        ("int32 num_nodes = 1;", "int32 node_count = 1;", 'changed name from "num_nodes" to "node_count"'),
        ("  rpc Explain(ExplainRequest) returns (ExplainResponse);\n", "", 'RPC "Explain" on service'),
    ],
)
def test_a_breaking_change_fails_naming_it(
    buf: Path, protos_copy: Path, old: str, new: str, complaint: str
) -> None:
    edit(protos_copy, old, new)
    check = breaking(buf, protos_copy)
    assert check.returncode != 0
    assert complaint in check.stdout, check.stdout + check.stderr


def test_lint_fails_on_a_badly_named_field(buf: Path, protos_copy: Path) -> None:
    edit(protos_copy, "  int32 gpus_per_node = 2;", "  int32 gpusPerNode = 2;")
    lint = run_buf(buf, protos_copy, "lint")
    assert lint.returncode != 0
    assert "gpusPerNode" in lint.stdout, lint.stdout + lint.stderr
