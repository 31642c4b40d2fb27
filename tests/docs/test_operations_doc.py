"""docs/operations.md tells the truth about every program's settings and metrics."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from tools import gen_settings_docs as gen

REPO = Path(__file__).resolve().parents[2]


def test_the_generated_reference_is_current() -> None:
    text = gen.DOC.read_text()
    assert gen.update(text, gen.generated_sections()) == text, (
        "docs/operations.md is stale: run `python -m tools.gen_settings_docs`"
    )


@pytest.mark.parametrize("program", gen.PROGRAMS, ids=lambda p: p.command)
def test_every_setting_is_documented_with_its_flag_and_variable(program: gen.ProgramDoc) -> None:
    text = gen.DOC.read_text()
    cls, prefix = gen.settings_of_entry_point(program.target)
    for field in dataclasses.fields(cls):
        flag, env = "--" + field.name.replace("_", "-"), prefix + field.name.upper()
        assert f"| `{flag}` | `{env}` |" in text, f"{program.command}: {flag} / {env} missing"


@pytest.mark.parametrize("program", gen.PROGRAMS, ids=lambda p: p.command)
def test_every_exported_metric_is_documented(program: gen.ProgramDoc) -> None:
    text = gen.DOC.read_text()
    families = gen.metric_families(program)
    assert families
    for family in families:
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{shown}` | {family.type} |" in text, f"{program.command}: metric {shown} missing"


def test_every_service_that_takes_settings_is_documented() -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    documented = {p.target for p in gen.PROGRAMS}
    for command, target in scripts.items():
        try:
            gen.settings_of_entry_point(target)
        except ValueError:
            continue  # an argparse tool (cdsim, cdctl, imex-sim), documented with its --help
        assert target in documented, f"{command} ({target}) has settings but no section in docs/operations.md"


def test_check_flags_a_stale_doc_and_a_run_makes_it_current(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "operations.md"
    stale.write_text(gen.DOC.read_text().replace("| `--etcd-endpoint` |", "| `--etcd-endpoint-old` |", 1))
    assert gen.main(["--check", "--doc", str(stale)]) == 1
    assert "is not current" in capsys.readouterr().err
    assert gen.main(["--doc", str(stale)]) == 0
    assert stale.read_text() == gen.DOC.read_text()
    assert gen.main(["--check", "--doc", str(stale)]) == 0


def test_a_doc_without_the_markers_is_an_error(tmp_path: Path) -> None:
    bare = tmp_path / "operations.md"
    bare.write_text("# Operations\n")
    assert gen.main(["--check", "--doc", str(bare)]) == 1
