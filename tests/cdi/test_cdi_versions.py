"""The cdiVersion rules, as the Go loader (specs-go/version.go) applies them."""

from __future__ import annotations

from typing import Any

import pytest

from libs.cdi import CdiVersionError, check_cdi_version, required_cdi_version


def spec_with(
    edits: dict[str, Any] | None = None,
    *,
    name: str = "dev",
    kind: str = "vendor.com/device",
    annotations: dict[str, str] | None = None,
    top_edits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    device = {"name": name, "containerEdits": edits or {"env": ["A=1"]}}
    spec: dict[str, Any] = {"cdiVersion": "0.3.0", "kind": kind, "devices": [device]}
    if annotations is not None:
        spec["annotations"] = annotations
    if top_edits is not None:
        spec["containerEdits"] = top_edits
    return spec


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (spec_with(), "0.3.0"),
        (spec_with({"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]}), "0.4.0"),
        (spec_with({"mounts": [{"hostPath": "/a", "containerPath": "/b"}]}), "0.3.0"),
        (spec_with({"deviceNodes": [{"path": "/dev/x", "hostPath": "/host/dev/x"}]}), "0.5.0"),
        (spec_with(top_edits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/h/x"}]}), "0.5.0"),
        (spec_with(name="0dev"), "0.5.0"),
        (spec_with(annotations={"a": "b"}), "0.6.0"),
        (spec_with(annotations={}), "0.3.0"),
        (spec_with(kind="vendor.com/dev.class"), "0.6.0"),
        (spec_with({"additionalGids": [5]}), "0.7.0"),
        (spec_with({"intelRdt": {"closID": "c"}}), "0.7.0"),
        (spec_with({"intelRdt": {"schemata": []}}), "1.1.0"),
        (spec_with({"intelRdt": {"enableMonitoring": True}}), "1.1.0"),
        (spec_with({"netDevices": [{"hostInterfaceName": "eth1", "name": "net0"}]}), "1.1.0"),
        # The newest feature decides.
        (spec_with({"deviceNodes": [{"path": "/x", "hostPath": "/y"}], "additionalGids": [1]}), "0.7.0"),
    ],
)
def test_required_version_per_feature(spec: dict[str, Any], expected: str) -> None:
    assert required_cdi_version(spec) == expected


def test_spec_claiming_older_version_than_its_features_is_refused_naming_the_feature() -> None:
    spec = spec_with({"deviceNodes": [{"path": "/dev/x", "hostPath": "/host/dev/x"}]})
    spec["cdiVersion"] = "0.4.0"
    with pytest.raises(CdiVersionError, match=r"hostPath on a device node needs 0\.5\.0"):
        check_cdi_version(spec)
    spec["cdiVersion"] = "0.6.0"  # newer than needed is fine for the loader
    check_cdi_version(spec)


@pytest.mark.parametrize("version", ["0.9.0", "2.0.0", "", "latest"])
def test_unknown_versions_are_refused(version: str) -> None:
    spec = spec_with()
    spec["cdiVersion"] = version
    with pytest.raises(CdiVersionError, match="unknown cdiVersion"):
        check_cdi_version(spec)


def test_versions_below_the_loader_floor_are_refused_even_without_features() -> None:
    spec = spec_with()
    spec["cdiVersion"] = "0.2.0"
    with pytest.raises(CdiVersionError):
        check_cdi_version(spec)
