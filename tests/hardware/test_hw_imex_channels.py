"""IMEX channel major from /proc/devices, and channel device nodes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libs.hardware.errors import ImexChannelsUnavailableError
from libs.hardware.imex_channels import (
    create_imex_channel_node,
    imex_channel_container_path,
    imex_channel_host_path,
    parse_imex_channel_major,
    read_imex_channel_major,
)
from tools.sim.hardware.simulated import render_proc_devices

GB200_PROC_DEVICES = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
 10 misc
195 nvidia-frontend
234 nvidia-caps-imex-channels
235 nvidia-caps
509 nvidia-nvswitch
510 nvidia-uvm

Block devices:
  7 loop
  8 sd
259 blkext
"""


def test_major_is_read_from_the_character_devices_line() -> None:
    assert parse_imex_channel_major(GB200_PROC_DEVICES) == 234


def test_missing_line_is_a_clear_error() -> None:
    text = GB200_PROC_DEVICES.replace("234 nvidia-caps-imex-channels\n", "")
    with pytest.raises(ImexChannelsUnavailableError, match="no 'nvidia-caps-imex-channels' character device"):
        parse_imex_channel_major(text)


def test_similarly_named_devices_do_not_count() -> None:
    text = GB200_PROC_DEVICES.replace("234 nvidia-caps-imex-channels\n", "")
    text += "300 nvidia-caps-imex-channels\n"  # in the block section
    with pytest.raises(ImexChannelsUnavailableError):
        parse_imex_channel_major(text)
    with pytest.raises(ImexChannelsUnavailableError):
        parse_imex_channel_major("Character devices:\n235 nvidia-caps\n236 nvidia-caps-imex-channels-x\n")


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "proc" / "devices"
    with pytest.raises(ImexChannelsUnavailableError, match=str(missing)):
        read_imex_channel_major(missing)


@pytest.mark.parametrize("major", [1, 234, 511, 4095])
def test_simulated_proc_devices_round_trips(major: int, tmp_path: Path) -> None:
    path = tmp_path / "devices"
    path.write_text(render_proc_devices(major))
    assert read_imex_channel_major(path) == major


def test_channel_paths() -> None:
    assert imex_channel_host_path(Path("/"), 0) == Path("/dev/nvidia-caps-imex-channels/channel0")
    assert imex_channel_host_path(Path("/run/nvidia/driver"), 7) == Path(
        "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel7"
    )
    assert imex_channel_container_path(2047) == "/dev/nvidia-caps-imex-channels/channel2047"
    with pytest.raises(ValueError):
        imex_channel_container_path(2048)


def test_existing_non_device_file_is_refused(tmp_path: Path) -> None:
    path = imex_channel_host_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text("not a device")
    with pytest.raises(ImexChannelsUnavailableError, match="not character device 234:0"):
        create_imex_channel_node(tmp_path, 0, 234)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs CAP_MKNOD")
def test_channel_device_node_is_created_with_major_and_minor(tmp_path: Path) -> None:
    try:
        path = create_imex_channel_node(tmp_path, 5, 234)
    except PermissionError:
        pytest.skip("mknod not permitted in this container")
    st = path.stat()
    assert stat.S_ISCHR(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (234, 5)
    assert st.st_mode & 0o777 == 0o666
    assert create_imex_channel_node(tmp_path, 5, 234) == path  # idempotent
    with pytest.raises(ImexChannelsUnavailableError):
        create_imex_channel_node(tmp_path, 5, 235)  # same path, other major
