"""Every spec file we write loads in a CDI runtime: schema, strict fields, loader rules, version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cdi_schema_check import cdi_check, loader_violations, schema_dir, schema_errors, unknown_fields

from libs.cdi import ClaimSpecDir, channels_for, check_cdi_version, claim_cdi_device_id
from libs.cdi.versions import version_key

MAJOR = 234
DIGIT_UID = "4914da61-1a20-42b3-bf26-981025df4289"
LETTER_UID = "c914da61-1a20-42b3-bf26-981025df4289"

CASES = [
    pytest.param(uid, mode, fabric, host, id=f"{label}-{mode}-{'fabric' if fabric else 'nonfabric'}-{hlabel}")
    for uid, label in ((DIGIT_UID, "digituid"), (LETTER_UID, "letteruid"))
    for mode, fabric in (("Single", True), ("All", True), ("All", False))
    for host, hlabel in ((None, "nohostpath"), ("/sim/rack0-tray1/dev", "hostpath"))
]


def write_and_read(tmp_path: Path, uid: str, mode: str, fabric: bool, host: str | None) -> dict[str, Any]:
    specdir = ClaimSpecDir(tmp_path / "cdi", host_dev_root=host)
    specdir.write(uid, channels=channels_for(mode, fabric=fabric), major=MAJOR)
    return json.loads(specdir.path_for(uid).read_bytes())


# jsonschema takes ~1 s over 2048 nodes; the letter-UID All files differ from the digit-UID ones
# only in the name and version, which the Single cases cover.
VALIDITY_CASES = [
    c for c in CASES if not (c.values[0] == LETTER_UID and c.values[1] == "All" and c.values[2])
]


@pytest.mark.parametrize(("uid", "mode", "fabric", "host"), VALIDITY_CASES)
def test_written_spec_passes_schema_strict_fields_and_loader_rules(
    tmp_path: Path, uid: str, mode: str, fabric: bool, host: str | None
) -> None:
    spec = write_and_read(tmp_path, uid, mode, fabric, host)
    assert schema_errors(spec) == []
    assert unknown_fields(spec) == []
    assert loader_violations(spec) == []
    check_cdi_version(spec)


@pytest.mark.parametrize(("uid", "mode", "fabric", "host"), CASES)
def test_written_spec_loads_and_injects_with_the_cdi_go_package(
    tmp_path: Path, uid: str, mode: str, fabric: bool, host: str | None
) -> None:
    spec = write_and_read(tmp_path, uid, mode, fabric, host)
    result = cdi_check(tmp_path / "cdi")
    device = claim_cdi_device_id(uid)
    assert result["errors"] == {}
    assert result["devices"] == [device]
    edits = spec["devices"][0]["containerEdits"]
    oci = result["injected"][device]
    assert oci["process"]["env"] == edits["env"]
    injected = [
        (d["path"], d["type"], d["major"], d["minor"]) for d in oci.get("linux", {}).get("devices", [])
    ]
    assert injected == [(n["path"], n["type"], n["major"], n["minor"]) for n in edits.get("deviceNodes", [])]


def test_cdi_go_package_rejects_a_spec_our_checks_reject(tmp_path: Path) -> None:
    spec = write_and_read(tmp_path, DIGIT_UID, "Single", True, None)
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["mode"] = 438
    (tmp_path / "cdi" / "bad.json").write_text(json.dumps(spec | {"kind": "vendor.com/other"}))
    result = cdi_check(tmp_path / "cdi")
    assert list(result["errors"]) == [str(tmp_path / "cdi" / "bad.json")]
    assert "mode" in result["errors"][str(tmp_path / "cdi" / "bad.json")][0]
    assert unknown_fields(spec) == ["/devices/0/containerEdits/deviceNodes/0/mode"]


@pytest.mark.parametrize(("uid", "mode", "fabric", "host"), CASES)
def test_cdi_version_is_the_minimum_covering_the_features_used(
    tmp_path: Path, uid: str, mode: str, fabric: bool, host: str | None
) -> None:
    spec = write_and_read(tmp_path, uid, mode, fabric, host)
    has_host_path = any("hostPath" in n for n in spec["devices"][0]["containerEdits"].get("deviceNodes", []))
    needs_050 = has_host_path or spec["devices"][0]["name"][0].isdigit()
    # The CDI specification: 0.5.0 added hostPath on device nodes and device names starting with a digit;
    # nothing else we use is versioned, and 0.3.0 is the oldest version the loader accepts.
    assert spec["cdiVersion"] == ("0.5.0" if needs_050 else "0.3.0")
    assert has_host_path == (fabric and host is not None)


def test_strict_checker_flags_unknown_fields_but_accepts_file_mode() -> None:
    spec: dict[str, Any] = {
        "cdiVersion": "0.3.0",
        "kind": "vendor.com/device",
        "devices": [
            {
                "name": "dev",
                "containerEdits": {"deviceNodes": [{"path": "/dev/x", "fileMode": 438, "mode": 438}]},
                "labels": {},
            }
        ],
        "extra": 1,
    }
    assert sorted(unknown_fields(spec)) == [
        "/devices/0/containerEdits/deviceNodes/0/mode",
        "/devices/0/labels",
        "/extra",
    ]


def test_schema_testdata_good_files_validate_and_bad_files_fail() -> None:
    testdata = schema_dir() / "testdata"
    good = sorted((testdata / "good").glob("*.json"))
    bad = sorted((testdata / "bad").glob("*.json"))
    assert good and bad
    for path in good:
        spec = json.loads(path.read_text())
        assert schema_errors(spec) == [], path.name
        assert unknown_fields(spec) == [], path.name
        check_cdi_version(spec)
    for path in bad:
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue  # not even JSON: the loader refuses it too
        assert schema_errors(spec), f"{path.name} should fail the schema"


def test_validator_rejects_our_spec_when_a_required_field_is_missing(tmp_path: Path) -> None:
    spec = write_and_read(tmp_path, DIGIT_UID, "Single", True, None)
    del spec["devices"][0]["containerEdits"]
    assert schema_errors(spec)
    spec = write_and_read(tmp_path, DIGIT_UID, "Single", True, None)
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["major"] = "234"
    assert schema_errors(spec)


def test_version_order_is_numeric_not_lexical() -> None:
    assert version_key("1.1.0") > version_key("0.10.0") > version_key("0.9.0")
    assert version_key("v0.5.0") == version_key("0.5.0")
