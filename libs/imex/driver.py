"""Which NVIDIA driver versions support what nvidia-imex is asked to do (pure, no imports).

Host names in the nodes config (instead of literal addresses) are supported from driver
570.158.01 on: its release notes say so, and kubernetes-sigs/dra-driver-nvidia-gpu PR 611 gates
the feature on that version. An older nvidia-imex takes each entry for an IP address, so a
domain whose nodes config holds slot names cannot start there.

The simulated daemon imports this module at start-up: it imports nothing at run time.
"""

from __future__ import annotations

HOST_NAMES_MIN_DRIVER_VERSION = "570.158.01"
# The release a simulated node runs unless its cluster description says otherwise (and what a
# simulated daemon whose config names no driver version assumes).
SIMULATED_DRIVER_VERSION = "580.95.05"


def parse_driver_version(text: str) -> tuple[int, ...]:
    """``"570.158.01"`` -> ``(570, 158, 1)``. ValueError if it is not dot-separated numbers."""
    parts = text.strip().split(".")
    if not text.strip() or not all(part.isdigit() for part in parts):
        raise ValueError(f"not a driver version: {text!r} (want numbers separated by dots, e.g. 580.95.05)")
    return tuple(int(part) for part in parts)


def supports_host_names(driver_version: str) -> bool:
    """Whether nvidia-imex of this driver accepts host names in its nodes config.

    ValueError if the version cannot be read (the caller decides; it is no proof of support)."""
    return parse_driver_version(driver_version) >= parse_driver_version(HOST_NAMES_MIN_DRIVER_VERSION)


def host_names_refusal(driver_version: str) -> str:
    """Why a daemon on this driver cannot use a nodes config of host names ('' if it can)."""
    try:
        if supports_host_names(driver_version):
            return ""
    except ValueError as exc:
        return f"cannot tell whether the driver supports host names in the nodes config: {exc}"
    return (
        f"driver {driver_version} is older than {HOST_NAMES_MIN_DRIVER_VERSION}: nvidia-imex accepts "
        f"host names in the nodes config only from driver {HOST_NAMES_MIN_DRIVER_VERSION} on"
    )
