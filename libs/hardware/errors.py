"""Exceptions of the hardware layer. Callers catch :class:`HardwareError` for all of them."""

from __future__ import annotations


class HardwareError(Exception):
    """A hardware query failed or the hardware is in a state we cannot use."""


class NvmlError(HardwareError):
    """An NVML call failed; ``code`` is the NVML return code, the message carries NVML's text."""

    def __init__(self, operation: str, code: int | None, detail: str) -> None:
        super().__init__(f"NVML {operation} failed: {detail}")
        self.operation = operation
        self.code = code
        self.detail = detail


class ImexChannelsUnavailableError(HardwareError):
    """The driver exposes no ``nvidia-caps-imex-channels`` character device."""


class UnknownNodeError(HardwareError):
    """A node name that the simulated cluster description does not contain."""
