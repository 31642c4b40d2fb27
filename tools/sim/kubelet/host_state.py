"""What a real kubelet could change on the host if its mount namespace leaked: a snapshot to compare
before and after (the kernel values it sets, the host paths it writes, the node IPs)."""

from __future__ import annotations

from pathlib import Path

from tools.sim.kubelet.addresses import addresses_in_range
from tools.sim.kubelet.node import KERNEL_TUNABLES

# Kubelet's hard-coded host paths; in its namespace they are the node's own folders.
KUBELET_HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/usr/libexec/kubernetes",
    "/etc/kubernetes",
)


def host_state() -> dict[str, object]:
    """The kernel tunables' values, which of kubelet's host paths exist, and our node IPs."""
    return {
        "sysctl": {t: Path("/proc/sys", t).read_text().strip() for t in KERNEL_TUNABLES},
        "paths": {p: Path(p).exists() for p in KUBELET_HOST_PATHS},
        "node_ips": sorted(addresses_in_range()),
        "mounts": sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()),
    }
