"""The committed libs/gen must be what protos/ generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.protogen", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubelet_api_is_wire_compatible() -> None:
    from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1, v1beta1
    from libs.gen.pluginregistration import PluginInfo

    # Field numbers as kubelet's api.proto: Device{request_names=1, pool_name=2, device_name=3, cdi_device_ids=4, share_id=5}.
    device = v1.Device(
        request_names=["channel"], pool_name="n1", device_name="channel-0", cdi_device_ids=["x"], share_id="s"
    )
    assert bytes(device) == b'\n\x07channel\x12\x02n1\x1a\tchannel-0"\x01x*\x01s'
    # v1beta1 has no share_id; the same bytes without field 5 decode identically.
    old = v1beta1.Device().parse(bytes(device))
    assert (old.pool_name, old.device_name, old.cdi_device_ids) == ("n1", "channel-0", ["x"])
    info = PluginInfo(
        type="DRAPlugin", name="compute-domain.nvidia.com", endpoint="/e", supported_versions=["v1.DRAPlugin"]
    )
    assert PluginInfo().parse(bytes(info)) == info
