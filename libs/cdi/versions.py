"""CDI spec versions and the features that require them.

The Go CDI loader (tags.cncf.io/container-device-interface, ``specs-go/version.go``) refuses a
spec whose ``cdiVersion`` is unknown to it or older than the newest feature the spec uses. An
older loader also refuses a version newer than it knows, so we always write the *minimum* version
that covers what a spec uses. The rules below restate the released-versions table of the CDI
specification as data; each rule inspects a spec in its JSON form (a dict as written to disk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Released spec versions, oldest first (the CDI specification's "Released versions").
KNOWN_VERSIONS: tuple[str, ...] = (
    "0.1.0",
    "0.2.0",
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
# The loader's floor: a spec using no versioned feature is reported as needing this version.
EARLIEST_VERSION = "0.3.0"

Spec = Mapping[str, Any]


class CdiVersionError(ValueError):
    """A spec's cdiVersion is unknown or older than the features it uses."""


def version_key(version: str) -> tuple[int, ...]:
    """Sortable key of a version string; a leading ``v`` is accepted as the loader does."""
    return tuple(int(part) for part in version.removeprefix("v").split("."))


def _edits(spec: Spec) -> Iterator[Mapping[str, Any]]:
    """Every containerEdits block: the spec-level one and each device's."""
    top = spec.get("containerEdits")
    if top:
        yield top
    for device in spec.get("devices") or ():
        edits = device.get("containerEdits")
        if edits:
            yield edits


def _any_edits(predicate: Callable[[Mapping[str, Any]], bool]) -> Callable[[Spec], bool]:
    return lambda spec: any(predicate(edits) for edits in _edits(spec))


def _rdt_v110_fields(edits: Mapping[str, Any]) -> bool:
    rdt = edits.get("intelRdt")
    # The loader tests `Schemata != nil`: an explicit empty list already counts.
    return rdt is not None and (rdt.get("schemata") is not None or bool(rdt.get("enableMonitoring")))


def _device_node_has_host_path(edits: Mapping[str, Any]) -> bool:
    return any(node.get("hostPath") for node in edits.get("deviceNodes") or ())


def _mount_has_type(edits: Mapping[str, Any]) -> bool:
    return any(mount.get("type") for mount in edits.get("mounts") or ())


def _has_annotations(spec: Spec) -> bool:
    return bool(spec.get("annotations")) or any(d.get("annotations") for d in spec.get("devices") or ())


def _dot_in_class(spec: Spec) -> bool:
    _, sep, cls = str(spec.get("kind", "")).partition("/")
    return bool(sep) and "." in cls


def _device_name_starts_with_digit(spec: Spec) -> bool:
    return any(str(d.get("name", ""))[:1].isdigit() for d in spec.get("devices") or ())


@dataclass(frozen=True)
class VersionRule:
    version: str
    feature: str
    used_by: Callable[[Spec], bool]


# Newest first, like the loader's table; the first rule that applies decides.
VERSION_RULES: tuple[VersionRule, ...] = (
    VersionRule("1.1.0", "netDevices in containerEdits", _any_edits(lambda e: bool(e.get("netDevices")))),
    VersionRule("1.1.0", "intelRdt.schemata or intelRdt.enableMonitoring", _any_edits(_rdt_v110_fields)),
    VersionRule("0.7.0", "intelRdt in containerEdits", _any_edits(lambda e: e.get("intelRdt") is not None)),
    VersionRule(
        "0.7.0", "additionalGids in containerEdits", _any_edits(lambda e: bool(e.get("additionalGids")))
    ),
    VersionRule("0.6.0", "annotations on the spec or a device", _has_annotations),
    VersionRule("0.6.0", "a dot in the class part of kind", _dot_in_class),
    VersionRule("0.5.0", "a device name starting with a digit", _device_name_starts_with_digit),
    VersionRule("0.5.0", "hostPath on a device node", _any_edits(_device_node_has_host_path)),
    VersionRule("0.4.0", "type on a mount", _any_edits(_mount_has_type)),
)


def features_used(spec: Spec) -> list[VersionRule]:
    """The versioned features ``spec`` uses, newest requirement first."""
    return [rule for rule in VERSION_RULES if rule.used_by(spec)]


def required_cdi_version(spec: Spec) -> str:
    """The minimum cdiVersion the Go loader accepts for ``spec``."""
    for rule in VERSION_RULES:
        if rule.used_by(spec):
            return rule.version
    return EARLIEST_VERSION


def check_cdi_version(spec: Spec) -> None:
    """Raise :class:`CdiVersionError` where the loader would refuse ``spec``'s cdiVersion."""
    claimed = str(spec.get("cdiVersion", ""))
    if claimed.removeprefix("v") not in KNOWN_VERSIONS:
        raise CdiVersionError(f"unknown cdiVersion {claimed!r}; known: {', '.join(KNOWN_VERSIONS)}")
    required = required_cdi_version(spec)
    if version_key(claimed) < version_key(required):
        needs = "; ".join(f"{r.feature} needs {r.version}" for r in features_used(spec))
        if not needs:
            needs = f"the loader accepts nothing older than {EARLIEST_VERSION}"
        raise CdiVersionError(f"cdiVersion {claimed} is older than the spec requires: {needs}")
