"""Claim spec files in the CDI root: content, ids, removal, listing, atomicity, speed."""

from __future__ import annotations

import json
import os
import stat
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from libs.cdi import (
    CHANNELS_ENV,
    ClaimSpecDir,
    build_claim_spec,
    channels_for,
    render_claim_spec,
)

MAJOR = 511
UID = "4914da61-1a20-42b3-bf26-981025df4289"
OTHER_UID = "8a1c2b3d-0000-4000-8000-000000000001"
SPEC_NAME = f"k8s.compute-domain.nvidia.com-claim_{UID}.json"


def read(specdir: ClaimSpecDir, uid: str = UID) -> Any:
    return json.loads(specdir.path_for(uid).read_bytes())


def test_single_channel_claim_injects_channel_zero_and_returns_its_cdi_id(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    cdi_id = specdir.write(UID, channels=channels_for("Single", fabric=True), major=MAJOR)

    assert cdi_id == f"k8s.compute-domain.nvidia.com/claim={UID}-channel-0"
    assert specdir.path_for(UID) == tmp_path / "cdi" / SPEC_NAME
    spec = read(specdir)
    assert spec["kind"] == "k8s.compute-domain.nvidia.com/claim"
    [device] = spec["devices"]
    assert device["name"] == f"{UID}-channel-0"
    assert device["containerEdits"]["deviceNodes"] == [
        {
            "path": "/dev/nvidia-caps-imex-channels/channel0",
            "type": "c",
            "major": MAJOR,
            "minor": 0,
            "fileMode": 0o666,
            "permissions": "rw",
        }
    ]
    assert device["containerEdits"]["env"] == [f"{CHANNELS_ENV}=0"]
    assert stat.S_IMODE(os.stat(specdir.path_for(UID)).st_mode) == 0o644


def test_all_mode_injects_all_2048_channels_with_minor_equal_to_channel(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    specdir.write(UID, channels=channels_for("All", fabric=True), major=MAJOR)
    edits = read(specdir)["devices"][0]["containerEdits"]
    nodes = edits["deviceNodes"]
    assert len(nodes) == 2048
    assert [n["path"] for n in nodes] == [f"/dev/nvidia-caps-imex-channels/channel{i}" for i in range(2048)]
    assert [n["minor"] for n in nodes] == list(range(2048))
    assert {n["major"] for n in nodes} == {MAJOR}
    assert edits["env"] == [f"{CHANNELS_ENV}=all"]


def test_non_fabric_node_gets_a_device_without_device_nodes(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    cdi_id = specdir.write(UID, channels=channels_for("All", fabric=False), major=None)
    assert cdi_id.endswith(f"={UID}-channel-0")
    edits = read(specdir)["devices"][0]["containerEdits"]
    assert "deviceNodes" not in edits
    assert edits == {"env": [f"{CHANNELS_ENV}=none"]}


def test_host_dev_root_sets_host_path_of_each_node(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi", host_dev_root="/sim/rack0-tray3/dev")
    specdir.write(UID, channels=range(2), major=MAJOR)
    nodes = read(specdir)["devices"][0]["containerEdits"]["deviceNodes"]
    assert [n["hostPath"] for n in nodes] == [
        "/sim/rack0-tray3/dev/nvidia-caps-imex-channels/channel0",
        "/sim/rack0-tray3/dev/nvidia-caps-imex-channels/channel1",
    ]
    assert [n["path"] for n in nodes] == [f"/dev/nvidia-caps-imex-channels/channel{i}" for i in range(2)]
    # The host's own /dev needs no hostPath (and so no newer cdiVersion).
    plain = ClaimSpecDir(tmp_path / "cdi2", host_dev_root="/dev")
    plain.write(UID, channels=range(1), major=MAJOR)
    assert "hostPath" not in read(plain)["devices"][0]["containerEdits"]["deviceNodes"][0]


@pytest.mark.parametrize("host", [None, "/sim/dev"])
@pytest.mark.parametrize("channels", [range(0), range(1), range(2048), (3, 7)])
def test_file_content_equals_the_spec_builder(channels: Sequence[int], host: str | None) -> None:
    data = render_claim_spec(UID, channels=channels, major=MAJOR, host_dev_root=host)
    assert json.loads(data) == build_claim_spec(UID, channels=channels, major=MAJOR, host_dev_root=host)


def test_rewrite_replaces_the_spec(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    specdir.write(UID, channels=range(2048), major=MAJOR)
    specdir.write(UID, channels=range(1), major=MAJOR)
    assert len(read(specdir)["devices"][0]["containerEdits"]["deviceNodes"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"channels": range(1), "major": None}, "major"),
        ({"channels": range(1), "major": 0}, "major"),
        ({"channels": (2048,), "major": MAJOR}, "out of range"),
        ({"channels": (-1,), "major": MAJOR}, "out of range"),
    ],
)
def test_invalid_device_parameters_are_refused_and_nothing_is_written(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    with pytest.raises(ValueError, match=message):
        specdir.write(UID, **kwargs)
    assert not (tmp_path / "cdi").exists() or list((tmp_path / "cdi").iterdir()) == []


@pytest.mark.parametrize("uid", ["", "../etc/passwd", "a/b", "-leading-dash", "with space"])
def test_claim_uids_that_cannot_name_a_cdi_device_are_refused(tmp_path: Path, uid: str) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    with pytest.raises(ValueError, match="claim UID"):
        specdir.write(uid, channels=range(1), major=MAJOR)
    with pytest.raises(ValueError, match="claim UID"):
        specdir.remove(uid)


def test_unknown_allocation_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="allocationMode"):
        channels_for("Some", fabric=True)


def test_remove_deletes_spec_and_missing_spec_is_success(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path / "cdi")
    specdir.write(UID, channels=range(1), major=MAJOR)
    assert specdir.remove(UID) is True
    assert not specdir.path_for(UID).exists()
    assert specdir.remove(UID) is False
    assert ClaimSpecDir(tmp_path / "never-created").remove(UID) is False


def test_remove_also_deletes_a_yaml_encoded_spec(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path)
    yaml_spec = tmp_path / f"k8s.compute-domain.nvidia.com-claim_{UID}.yaml"
    yaml_spec.write_text("cdiVersion: 0.5.0\n")
    assert specdir.remove(UID) is True
    assert not yaml_spec.exists()


def test_listing_returns_our_claims_only_and_ignores_temp_litter(tmp_path: Path) -> None:
    specdir = ClaimSpecDir(tmp_path)
    specdir.write(UID, channels=range(1), major=MAJOR)
    specdir.write(OTHER_UID, channels=range(0), major=None)
    (tmp_path / f".k8s.compute-domain.nvidia.com-claim_{'f' * 8}.json.x1y2.tmp").write_text("{")
    (tmp_path / "k8s.gpu.nvidia.com-claim_abc.json").write_text("{}")
    (tmp_path / "k8s.compute-domain.nvidia.com-claim_abc.json.bak").write_text("{}")
    (tmp_path / "nvidia.yaml").write_text("")
    assert specdir.claim_uids() == sorted([UID, OTHER_UID])
    assert ClaimSpecDir(tmp_path / "missing").claim_uids() == []


def test_crash_before_rename_leaves_no_spec_under_the_final_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specdir = ClaimSpecDir(tmp_path)

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        specdir.write(UID, channels=range(2048), major=MAJOR)
    assert not specdir.path_for(UID).exists()
    assert list(tmp_path.iterdir()) == []  # the temp file was cleaned up
    assert specdir.claim_uids() == []


def test_crash_before_rename_keeps_the_previous_spec_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specdir = ClaimSpecDir(tmp_path)
    specdir.write(UID, channels=range(1), major=MAJOR)
    before = specdir.path_for(UID).read_bytes()

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        specdir.write(UID, channels=range(2048), major=MAJOR)
    assert specdir.path_for(UID).read_bytes() == before


def test_temp_file_left_by_a_hard_crash_is_not_a_spec_and_is_cleaned_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specdir = ClaimSpecDir(tmp_path)

    # A process killed between write and rename leaves its temp file behind (unlink never runs).
    def killed(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    monkeypatch.setattr(os, "unlink", lambda path: None)
    with pytest.raises(KeyboardInterrupt):
        specdir.write(UID, channels=range(1), major=MAJOR)
    monkeypatch.undo()
    litter = list(tmp_path.iterdir())
    assert len(litter) == 1
    assert not litter[0].name.endswith((".json", ".yaml"))  # the CDI loader only reads these
    assert specdir.claim_uids() == []

    foreign_temp = tmp_path / ".some-other-vendor.json.abc.tmp"
    foreign_temp.write_text("x")
    assert specdir.remove_stale_temps() == litter
    assert list(tmp_path.iterdir()) == [foreign_temp]


def test_all_mode_spec_renders_in_well_under_a_millisecond_typical() -> None:
    # A prepare must stay within a few ms; the 2048-node array is encoded once and reused.
    render_claim_spec(UID, channels=range(2048), major=MAJOR)
    samples = []
    for _ in range(21):
        start = time.perf_counter()
        render_claim_spec(UID, channels=range(2048), major=MAJOR)
        samples.append(time.perf_counter() - start)
    assert statistics.median(samples) < 0.003


def test_prewarm_encodes_the_all_mode_array_before_the_first_prepare(tmp_path: Path) -> None:
    from libs.cdi.spec import _channel_nodes

    specdir = ClaimSpecDir(tmp_path, host_dev_root="/prewarm-test/dev")
    specdir.prewarm(MAJOR)
    misses = _channel_nodes.cache_info().misses
    specdir.write(UID, channels=channels_for("All", fabric=True), major=MAJOR)
    assert _channel_nodes.cache_info().misses == misses
    assert specdir.claim_uids() == [UID]  # prewarming writes nothing
