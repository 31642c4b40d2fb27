"""The Kubernetes release the shim plays the kubelet of: the control plane's own.

A kubelet is as new as its control plane (or older), so the shim reads the API server's version
(``GET /version``) and the resource.k8s.io version it serves once at start, and from them takes
the ``kubeletVersion`` it reports on its Nodes, the version of the ResourceClaims it reads, and
the DRA gRPC services it would speak to a plugin: kubelets 1.34 and later prefer ``v1.DRAPlugin``
and still accept ``v1beta1.DRAPlugin``; 1.32 and 1.33 know only ``v1beta1.DRAPlugin``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from libs.kube.resource_api import ServedVersion

DEFAULT_GIT_VERSION = "v1.37.2"
SHIM_SUFFIX = "-kubeletshim"
DRA_V1 = "v1.DRAPlugin"
DRA_V1BETA1 = "v1beta1.DRAPlugin"


def minor_of(git_version: str) -> int:
    """37 for "v1.37.2" (also "v1.37.2-gke.1" and the like); ValueError naming the problem."""
    match = re.match(r"^v?1\.(\d+)", git_version)
    if not match:
        raise ValueError(f"{git_version!r} is not a Kubernetes version such as v1.37.2")
    return int(match.group(1))


@dataclass(frozen=True)
class KubeletRelease:
    git_version: str = DEFAULT_GIT_VERSION  # the control plane's, e.g. v1.32.13
    resource_api: str = "v1"  # the resource.k8s.io version it serves

    @property
    def kubelet_version(self) -> str:
        """Node.status.nodeInfo.kubeletVersion: the release, marked as the shim's."""
        return self.git_version + SHIM_SUFFIX

    @property
    def dra_services(self) -> tuple[str, ...]:
        """The DRA gRPC services this kubelet speaks, most preferred first."""
        if minor_of(self.git_version) >= 34:
            return (DRA_V1, DRA_V1BETA1)
        return (DRA_V1BETA1,)


async def discover_release(api: Any, timeout_s: float) -> KubeletRelease:
    """Ask the API server (raises the client's errors and ResourceApiUnavailable; the caller retries)."""
    from kubernetes_asyncio.client import VersionApi

    async with asyncio.timeout(timeout_s):
        info = await VersionApi(api).get_code(_request_timeout=timeout_s)
    git_version = str(info.git_version)
    minor_of(git_version)  # refuse what is not a version before using it
    resource_api = await ServedVersion(api, timeout_s=timeout_s).get()
    return KubeletRelease(git_version, resource_api)
