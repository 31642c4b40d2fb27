"""The configuration files of one node's containerd: its TOML (own root, state and sockets, the
CRI's CDI directory and sandbox image) and its CNI network (one bridge shared by every node of the
environment, a range of the pod network per node, no gateway, no masquerade)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

# Pods of every node share this /16, one /24 of it per node; nothing routes out of it (the bridge
# lives in a network namespace of its own, see tools.containerd.network).
POD_NETWORK = ipaddress.IPv4Network("10.88.0.0/16")
BRIDGE_NAME = "cd-pods0"
CNI_NETWORK_NAME = "cd-pods"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
RUNC = Path("/usr/sbin/runc")  # Debian's runc


def pod_range(ordinal: int) -> tuple[str, str]:
    """The first and last pod address of node `ordinal` (its own /24 of POD_NETWORK)."""
    subnets = list(POD_NETWORK.subnets(new_prefix=24))
    if not 0 <= ordinal < len(subnets):
        raise ValueError(f"node ordinal {ordinal} out of range [0, {len(subnets)}) for {POD_NETWORK}")
    hosts = list(subnets[ordinal].hosts())
    # .1 stays free: a gateway would take it, and there is none.
    return str(hosts[1]), str(hosts[-1])


def cni_conflist(ordinal: int, ipam_dir: Path) -> dict[str, object]:
    first, last = pod_range(ordinal)
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE_NAME,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(POD_NETWORK), "rangeStart": first, "rangeEnd": last}]],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def _toml_string(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


@dataclass(frozen=True)
class ContainerdPaths:
    """Everything one node's containerd keeps, under the node's state dir (short: sockets live here)."""

    base: Path

    @property
    def config(self) -> Path:
        return self.base / "containerd.toml"

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def root(self) -> Path:
        return self.base / "containerd-root"

    @property
    def state(self) -> Path:
        return self.base / "containerd-state"

    @property
    def cni_conf_dir(self) -> Path:
        return self.base / "cni-conf"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.base / "cni-ipam"


def containerd_toml(paths: ContainerdPaths, cdi_dir: Path, sandbox_image: str) -> str:
    """containerd 2.x configuration (version 3) for one node's CRI."""
    s = _toml_string
    return f"""version = 3
root = {s(paths.root)}
state = {s(paths.state)}
# This machine refuses to lower a process's oom_score_adj: leave every score as it is.
oom_score = 0
# Nothing from the host's /etc/containerd.
imports = []

[grpc]
  address = {s(paths.socket)}

[ttrpc]
  address = {s(str(paths.socket) + ".ttrpc")}

[debug]
  address = ""

[metrics]
  address = ""

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {s(sandbox_image)}

[plugins.'io.containerd.cri.v1.runtime']
  # Without it every sandbox fails with runc's "can't get final child's PID from pipe: EOF":
  # runc cannot set a score lower than containerd's own here.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  # CDI is always on in containerd 2.x: the kubelet plugin's specs are read from here.
  cdi_spec_dirs = [{s(cdi_dir)}]

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = {s(RUNC)}
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{s(CNI_BIN_DIR)}]
  conf_dir = {s(paths.cni_conf_dir)}
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

# The plugins whose default paths are the host's (/opt/containerd, /var/run/nri, /etc/nri):
# theirs are the node's, or they are off.
[plugins.'io.containerd.internal.v1.opt']
  path = {s(paths.base / "opt")}

[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = {s(paths.base / "image-verifier")}

[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""


def write_node_config(paths: ContainerdPaths, ordinal: int, cdi_dir: Path, sandbox_image: str) -> None:
    for d in (paths.base, paths.cni_conf_dir, paths.cni_ipam_dir):
        d.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(containerd_toml(paths, cdi_dir, sandbox_image))
    conflist = cni_conflist(ordinal, paths.cni_ipam_dir)
    (paths.cni_conf_dir / "10-cd-pods.conflist").write_text(json.dumps(conflist, indent=2))
