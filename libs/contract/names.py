"""The names the driver answers to (kept exactly as NVIDIA's driver spells them)."""

from __future__ import annotations

DRIVER_NAME = "compute-domain.nvidia.com"
# The one device a node publishes per IMEX channel pool, and the request that asks for it.
CHANNEL_DEVICE = "channel-0"
CHANNEL_REQUEST = "channel"
CHANNEL_DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
# The opaque parameters of a channel request.
CHANNEL_CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"
CHANNEL_CONFIG_KIND = "ComputeDomainChannelConfig"
# Why an IMEX daemon is not READY, beyond its state: written by the IMEX agent into the daemon's
# status record (`reason`), shown by the controller as the domain's Ready condition reason, and
# named in the error a prepare on that node returns (ours, additive to NVIDIA's status).
REASON_WAITING_FOR_RECOVERY = "ImexDaemonWaitingForRecovery"
REASON_DRIVER_TOO_OLD = "ImexDriverTooOld"
