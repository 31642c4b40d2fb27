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
