"""A claim as kubelet names it and as its source resolves it (what was allocated and configured), and
the port of that source (its adapters: wire/claim_source.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One allocated device (``status.allocation.devices.results[]``)."""

    request: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True, slots=True)
class OpaqueParameters:
    """One opaque driver configuration (``status.allocation.devices.config[]``)."""

    driver: str
    requests: tuple[str, ...]
    # The parsed "parameters" object for our driver; other drivers' parameters stay as given.
    parameters: Any
    source: str = ""

    def applies_to(self, request: str) -> bool:
        """Empty ``requests`` means every request; a parent request covers its subrequests."""
        if not self.requests:
            return True
        return request in self.requests or request.split("/", 1)[0] in self.requests


@dataclass(frozen=True, slots=True)
class ResolvedClaim:
    ref: ClaimRef
    # Changes when the claim object changes (Kubernetes resourceVersion, store mod revision);
    # unprepare tombstones compare it so that a re-used shared claim is not refused.
    version: str
    results: tuple[DeviceResult, ...]
    configs: tuple[OpaqueParameters, ...]

    def results_for(self, driver: str, pool: str) -> tuple[DeviceResult, ...]:
        return tuple(r for r in self.results if r.driver == driver and r.pool == pool)

    def config_for(self, driver: str, request: str) -> OpaqueParameters | None:
        """The configuration in effect for ``request``: the last applicable one (class configs
        come first, claim configs after them and take precedence)."""
        found: OpaqueParameters | None = None
        for config in self.configs:
            if config.driver == driver and config.applies_to(request):
                found = config
        return found


class ClaimSource(Protocol):
    async def resolve(self, ref: ClaimRef) -> ResolvedClaim:
        """The claim's allocation. Raises :class:`ClaimGone` when the claim does not exist (or
        the name belongs to another UID), :class:`RetryableClaimError` when the source is unreachable,
        :class:`PermanentClaimError` when the claim is unusable."""
        ...
