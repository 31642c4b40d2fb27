"""The DeviceClass selects exactly the channel device our node agent publishes."""

from __future__ import annotations

from typing import Any

import celpy
import pytest

from services.nodeagent.wire.resourceslice import build_resource_slice
from tests.manifests.objects import Obj, find

DRIVER = "compute-domain.nvidia.com"
NVIDIA_EXPRESSION = (
    "device.driver == 'compute-domain.nvidia.com' && "
    "device.attributes['compute-domain.nvidia.com'].type == 'channel' && "
    "device.attributes['compute-domain.nvidia.com'].id == 0"
)


@pytest.fixture(scope="module")
def device_class(rendered: dict[str, list[Obj]]) -> Obj:
    return find(rendered["base"], "DeviceClass", "compute-domain-default-channel.nvidia.com")


def cel_devices(resource_slice: dict[str, Any]) -> list[Any]:
    """The slice's devices as DRA's CEL sees them: attributes grouped by domain, an unqualified
    attribute name belonging to the driver's domain."""
    driver = resource_slice["spec"]["driver"]
    devices = []
    for device in resource_slice["spec"]["devices"]:
        attributes: dict[str, dict[str, Any]] = {}
        for name, typed in device.get("attributes", {}).items():
            domain, _, short = name.rpartition("/")
            [(kind, value)] = typed.items()
            assert kind in ("string", "int", "bool"), f"attribute type {kind} not handled here"
            attributes.setdefault(domain or driver, {})[short] = value
        devices.append(celpy.json_to_cel({"driver": driver, "attributes": attributes}))
    return devices


def selects(device_class: Obj, device: Any) -> bool:
    env = celpy.Environment()
    for selector in device_class["spec"]["selectors"]:
        result = env.program(env.compile(selector["cel"]["expression"])).evaluate({"device": device})
        if result != celpy.celtypes.BoolType(True):
            return False
    return True


def test_is_nvidias_device_class(device_class: Obj) -> None:
    assert device_class["apiVersion"] == "resource.k8s.io/v1"
    assert device_class["spec"]["selectors"] == [{"cel": {"expression": NVIDIA_EXPRESSION}}]


@pytest.mark.parametrize(
    "clique", ["9277d399-0674-44a9-b64e-d85bb19ce2b0.32766", ""], ids=["fabric", "non-fabric"]
)
def test_selects_the_channel_our_node_agent_publishes(device_class: Obj, clique: str) -> None:
    published = build_resource_slice("rack0-tray0", clique)
    [device] = cel_devices(published)
    assert selects(device_class, device)


@pytest.mark.parametrize(
    ("driver", "attributes"),
    [
        ("gpu.nvidia.com", {"type": {"string": "channel"}, "id": {"int": 0}}),
        (DRIVER, {"type": {"string": "channel"}, "id": {"int": 1}}),
        (DRIVER, {"type": {"string": "daemon"}, "id": {"int": 0}}),
    ],
    ids=["other-driver", "other-channel", "daemon-device"],
)
def test_does_not_select_other_devices(device_class: Obj, driver: str, attributes: dict[str, Any]) -> None:
    other = {"spec": {"driver": driver, "devices": [{"name": "d", "attributes": attributes}]}}
    [device] = cel_devices(other)
    assert not selects(device_class, device)
