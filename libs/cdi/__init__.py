"""CDI spec files for ComputeDomain channel claims."""

from libs.cdi.spec import (
    ALLOCATION_ALL,
    ALLOCATION_SINGLE,
    CHANNELS_ENV,
    KIND,
    MAX_CHANNELS,
    VENDOR,
    build_claim_spec,
    channels_for,
    claim_cdi_device_id,
    claim_device_name,
    render_claim_spec,
)
from libs.cdi.spec_dir import DEFAULT_CDI_ROOT, ClaimSpecDir
from libs.cdi.versions import CdiVersionError, check_cdi_version, required_cdi_version

__all__ = [
    "ALLOCATION_ALL",
    "ALLOCATION_SINGLE",
    "CHANNELS_ENV",
    "DEFAULT_CDI_ROOT",
    "KIND",
    "MAX_CHANNELS",
    "VENDOR",
    "CdiVersionError",
    "ClaimSpecDir",
    "build_claim_spec",
    "channels_for",
    "check_cdi_version",
    "claim_cdi_device_id",
    "claim_device_name",
    "render_claim_spec",
    "required_cdi_version",
]
