"""The skips `make test` accepts, each with its reason; any other skip fails the run.

A skip hides a test that proves nothing on this run, so it must be rare and explained. Keys are
pytest node ids (without parameters); values say why the skip is legitimate. `conftest.py`
enforces the list at the end of the session.
"""

from __future__ import annotations

ALLOWED_SKIPS: dict[str, str] = {
    "tests/hardware/test_hw_nvml.py::test_real_pynvml_without_a_driver_fails_cleanly": (
        "checks the error path of real NVML without a driver; on a GPU host the driver is there "
        "and the real-GPU tests cover it"
    ),
    "tests/hardware/test_hw_imex_channels.py::test_channel_device_node_is_created_with_major_and_minor": (
        "mknod needs CAP_MKNOD, which an unprivileged developer or a restricted container lacks; "
        "CI runs as root, where it runs"
    ),
}


def unexpected(skipped: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (node id, reason) pairs whose test is not in ALLOWED_SKIPS. Pure."""
    return [(nodeid, why) for nodeid, why in skipped if nodeid.split("[", 1)[0] not in ALLOWED_SKIPS]
