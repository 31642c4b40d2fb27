"""docs/migration.md names only what exists: our flags, environment variables and metrics (with
their labels), files and tests; its commands are the ones the end-to-end test runs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from tests.e2e.test_nvidia_leftovers import LEFTOVER_CLEANUP, REPLACE_CRD
from tools import gen_settings_docs as gen

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "migration.md"
# Flags of other programs (helm) that the guide names inline.
FOREIGN_FLAGS = {"--reuse-values", "--set"}


def inline_code() -> list[str]:
    """The guide's inline code spans, outside fenced blocks."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def our_settings() -> tuple[set[str], set[str]]:
    """Every flag and environment variable of our programs."""
    flags, envs = set(), set()
    for program in gen.PROGRAMS:
        cls, prefix = gen.settings_of_entry_point(program.target)
        for field in dataclasses.fields(cls):
            flags.add("--" + field.name.replace("_", "-"))
            envs.add(prefix + field.name.upper())
    return flags, envs


def test_every_flag_and_variable_named_is_a_setting_of_ours() -> None:
    flags, envs = our_settings()
    named_flags = {m for span in inline_code() for m in re.findall(r"--[a-z][a-z-]*", span)} - FOREIGN_FLAGS
    named_envs = {m for span in inline_code() for m in re.findall(r"\bCD_[A-Z_]+", span)}
    assert {"--imex-mesh-tls", "--node-ip"} <= named_flags
    assert named_flags <= flags, named_flags - flags
    assert named_envs and named_envs <= envs, named_envs - envs


def test_every_metric_named_is_served_with_the_labels_named() -> None:
    served = {
        f.name + ("_total" if f.type == "counter" else "")
        for p in gen.PROGRAMS
        for f in gen.metric_families(p)
    }
    reference = gen.DOC.read_text()  # the generated metrics tables (tests/docs/test_operations_doc.py)
    named = [m for span in inline_code() for m in re.findall(r"\b(cd_[a-z_]+)(?:\{([a-z_]+))?", span)]
    assert len({name for name, _ in named}) >= 6, named
    for name, label in named:
        assert name in served, f"{name} is not a metric of ours"
        if label:
            row = re.search(rf"^\| `{name}` \| \w+ \| ([^|]*) \|", reference, flags=re.M)
            assert row is not None and f"`{label}`" in row.group(1), f"{name} has no label {label}"


def test_every_file_and_test_named_exists() -> None:
    spans = inline_code()
    paths = [
        s
        for s in spans
        if re.fullmatch(r"(docs|tests|manifests|deployments|services|libs|tools)/[\w./-]+", s)
    ]
    assert "tests/e2e/test_nvidia_leftovers.py" in paths
    for path in paths:
        assert (REPO / path).exists(), path
    test_sources = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    tests = [s for s in spans if re.fullmatch(r"test_\w+", s)]
    assert len(tests) >= 8, tests
    for name in tests:
        assert re.search(rf"^(async )?def {name}\(", test_sources, flags=re.M), f"no test {name}"


def test_the_commands_are_the_ones_the_end_to_end_test_runs() -> None:
    text = DOC.read_text()
    assert LEFTOVER_CLEANUP in text
    assert REPLACE_CRD in text


def test_nothing_of_ours_uses_computedomaincliques() -> None:
    # The chart's schema names NVIDIA's feature gate ComputeDomainCliques only to refuse it (true).
    schema_path = REPO / "deployments/helm/compute-domains/values.schema.json"
    schema = json.loads(schema_path.read_text())
    gate = schema["properties"]["featureGates"]["properties"].pop("ComputeDomainCliques")
    assert gate["const"] is False
    assert "computedomainclique" not in json.dumps(schema).lower()
    for root in ("libs", "services", "tools", "manifests", "deployments", "integrations"):
        for path in (REPO / root).rglob("*"):
            suffixes = {".py", ".yaml", ".yml", ".json", ".tpl", ".proto", ".go"}
            if path.is_file() and path.suffix in suffixes and path != schema_path:
                assert "computedomainclique" not in path.read_text(errors="replace").lower(), path
