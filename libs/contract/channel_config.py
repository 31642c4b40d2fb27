"""The opaque ``ComputeDomainChannelConfig`` parameters: built, and decoded strictly (pure).

The workload ResourceClaimTemplate carries, for driver ``compute-domain.nvidia.com``::

    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
     "domainID": "<CD uid>", "allocationMode": "Single" | "All"}

Decoding is strict like Kubernetes' own (sigs.k8s.io/json strict mode): field names are case
sensitive, an unknown or duplicated field is an error naming it, types must match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libs.cdi.spec import ALLOCATION_ALL, ALLOCATION_SINGLE
from libs.contract.names import CHANNEL_CONFIG_API_VERSION as API_VERSION
from libs.contract.names import CHANNEL_CONFIG_KIND as KIND
from libs.contract.names import DRIVER_NAME

ALLOCATION_MODES = (ALLOCATION_SINGLE, ALLOCATION_ALL)

_FIELDS = ("apiVersion", "kind", "domainID", "allocationMode")


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    domain_id: str
    allocation_mode: str


class ConfigError(ValueError):
    """The opaque parameters are not a valid ComputeDomainChannelConfig."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid opaque config for {DRIVER_NAME}: {detail}")


def channel_config(domain_id: str, allocation_mode: str = ALLOCATION_SINGLE) -> dict[str, str]:
    """The parameters object a workload's claim carries for the domain (what the controller puts
    in the ResourceClaimTemplate); `decode_channel_config` reads it back."""
    if allocation_mode not in ALLOCATION_MODES:
        raise ValueError(f"invalid allocation mode {allocation_mode!r}: must be Single or All")
    return {"apiVersion": API_VERSION, "kind": KIND, "domainID": domain_id, "allocationMode": allocation_mode}


def channel_config_json(domain_id: str, allocation_mode: str = ALLOCATION_SINGLE) -> str:
    """`channel_config` as compact JSON (the apiserver compares opaque parameters byte for byte)."""
    return json.dumps(channel_config(domain_id, allocation_mode), separators=(",", ":"))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f'duplicate field "{key}"')
        out[key] = value
    return out


def parse_parameters_json(text: str) -> Any:
    """The parameters object from its JSON text (how the simulation's claim records hold it)."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"parameters are not valid JSON: {exc}") from None


def _string(params: dict[str, Any], name: str, *, required: bool) -> str:
    if name not in params:
        if required:
            raise ConfigError(f'missing required field "{name}"')
        return ""
    value = params[name]
    if not isinstance(value, str):
        raise ConfigError(f'field "{name}" must be a string, got {json.dumps(value)}')
    return value


def decode_channel_config(params: Any) -> ChannelConfig:
    """Decode an already parsed parameters object; raises :class:`ConfigError`."""
    if not isinstance(params, dict):
        raise ConfigError(f"parameters must be an object, got {type(params).__name__}")
    unknown = [name for name in params if name not in _FIELDS]
    if unknown:
        raise ConfigError(f'unknown field "{unknown[0]}" in {KIND}')
    api_version = _string(params, "apiVersion", required=True)
    if api_version != API_VERSION:
        raise ConfigError(f'field "apiVersion" must be "{API_VERSION}", got "{api_version}"')
    kind = _string(params, "kind", required=True)
    if kind != KIND:
        raise ConfigError(f'field "kind" must be "{KIND}", got "{kind}"')
    domain_id = _string(params, "domainID", required=True)
    if not domain_id or "/" in domain_id or domain_id.strip() != domain_id:
        raise ConfigError(f'field "domainID" must be a ComputeDomain UID, got "{domain_id}"')
    mode = _string(params, "allocationMode", required=False) or ALLOCATION_SINGLE
    if mode not in ALLOCATION_MODES:
        raise ConfigError(f'field "allocationMode" must be one of {"|".join(ALLOCATION_MODES)}, got "{mode}"')
    return ChannelConfig(domain_id=domain_id, allocation_mode=mode)
