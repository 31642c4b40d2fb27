"""IMEX channel character devices: their major number and their paths.

The driver registers the ``nvidia-caps-imex-channels`` character device with a dynamically
allocated major, visible only in ``/proc/devices``; channel N is minor N. On the host the nodes
live under the driver's dev root; inside a container they always appear at
``/dev/nvidia-caps-imex-channels/channel<N>`` (the path the CDI spec gives).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libs.hardware.errors import ImexChannelsUnavailableError

IMEX_CHANNELS_DEVICE_NAME = "nvidia-caps-imex-channels"
IMEX_CHANNELS_DIR = "dev/nvidia-caps-imex-channels"
IMEX_CHANNEL_COUNT = 2048
"""Channels the driver provides (``allocationMode: All`` injects all of them)."""

DEFAULT_PROC_DEVICES = Path("/proc/devices")


def parse_imex_channel_major(proc_devices_text: str, source: str = "/proc/devices") -> int:
    """The major of ``nvidia-caps-imex-channels`` from the text of ``/proc/devices``.

    Only the ``Character devices:`` section counts (a block device of the same name would be a
    different thing). Raises ImexChannelsUnavailableError when the line is absent or malformed.
    """
    in_character_section = True  # a bare list without headers is read as character devices
    for raw in proc_devices_text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.endswith(":"):
            in_character_section = line.lower() == "character devices:"
            continue
        if not in_character_section:
            continue
        fields = line.split()
        if len(fields) == 2 and fields[1] == IMEX_CHANNELS_DEVICE_NAME:
            if not fields[0].isdigit():
                raise ImexChannelsUnavailableError(
                    f"malformed {IMEX_CHANNELS_DEVICE_NAME} line in {source}: {raw!r}"
                )
            return int(fields[0])
    raise ImexChannelsUnavailableError(
        f"no '{IMEX_CHANNELS_DEVICE_NAME}' character device in {source}: the NVIDIA driver is not loaded "
        "or does not support IMEX channels"
    )


def read_imex_channel_major(proc_devices: Path = DEFAULT_PROC_DEVICES) -> int:
    try:
        text = proc_devices.read_text()
    except OSError as exc:
        raise ImexChannelsUnavailableError(f"cannot read {proc_devices}: {exc.strerror or exc}") from exc
    return parse_imex_channel_major(text, str(proc_devices))


def _check_channel(channel: int) -> None:
    if not 0 <= channel < IMEX_CHANNEL_COUNT:
        raise ValueError(f"IMEX channel {channel} out of range [0, {IMEX_CHANNEL_COUNT})")


def imex_channel_container_path(channel: int) -> str:
    """Where channel N appears inside a container (the CDI device node path)."""
    _check_channel(channel)
    return f"/{IMEX_CHANNELS_DIR}/channel{channel}"


def imex_channel_host_path(dev_root: Path, channel: int) -> Path:
    """Where channel N lives on the host: ``<dev root>/dev/nvidia-caps-imex-channels/channel<N>``."""
    _check_channel(channel)
    return dev_root / IMEX_CHANNELS_DIR / f"channel{channel}"


def create_imex_channel_node(dev_root: Path, channel: int, major: int) -> Path:
    """Create the character device for channel N (needs CAP_MKNOD) unless it already exists.

    An existing node with another major/minor is an error: it would hand out a different channel.
    """
    path = imex_channel_host_path(dev_root, channel)
    wanted = os.makedev(major, channel)
    try:
        st = path.stat()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, wanted)
        except FileExistsError:
            pass  # created concurrently; verified below
        else:
            os.chmod(path, 0o666)  # mknod honours the umask
            return path
        st = path.stat()
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != wanted:
        raise ImexChannelsUnavailableError(f"{path} exists but is not character device {major}:{channel}")
    return path
