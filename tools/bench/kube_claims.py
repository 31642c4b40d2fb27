"""ResourceClaims on a real kube-apiserver, for benchmarks that read claims as Kubernetes mode does.

A node agent in Kubernetes mode resolves each claim kubelet names with a GET of the ResourceClaim
(services/nodeagent/wire/claim_source.py). :class:`ApiServer` is the loopback control plane's etcd
(fsynced, as a production control plane's) and kube-apiserver, nothing else: no scheduler or
controller manager shares the cores. :func:`create_allocated_claims` writes claims allocated the
way kube-scheduler allocates the channel (the status subresource, with the request's opaque
channel configuration), so the agent's GET returns what it would on a cluster.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.contract.channel_config import channel_config
from libs.contract.names import CHANNEL_DEVICE, CHANNEL_DEVICE_CLASS, CHANNEL_REQUEST, DRIVER_NAME
from libs.kube.client import without_env_lookups
from libs.kube.resource_api import device_request, resource_path
from tools.bench.k8s_env import DurableControlPlane
from tools.controlplane.cluster import SERVICE_IP, ControlPlaneError
from tools.controlplane.pki import generate_pki
from tools.net_ports import free_ports

RESOURCE_VERSION = "v1"
_TIMEOUT_S = 30.0


class ApiServer(DurableControlPlane):
    """etcd (fsynced) and kube-apiserver of the loopback control plane, without its controllers."""

    def start(self) -> None:
        if self._procs:
            raise ControlPlaneError("API server already started")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        etcd_client, etcd_peer, apiserver = free_ports(3)
        self.etcd_url = f"http://127.0.0.1:{etcd_client}"
        self.server = f"https://127.0.0.1:{apiserver}"
        pki = self._pki = generate_pki(self.pki_dir, SERVICE_IP)
        self._write_kubeconfigs(pki)
        deadline = time.monotonic() + self._startup_timeout_s
        try:
            self._spawn("etcd", self._etcd_cmd(etcd_client, etcd_peer))
            self._await("etcd", deadline, self._etcd_healthy)
            self._spawn("kube-apiserver", self._apiserver_cmd(apiserver))
            self._await("kube-apiserver", deadline, self._apiserver_ready)
        except BaseException:
            self.stop()
            raise


async def api_client(kubeconfig: Path) -> Any:
    """A kubernetes-asyncio client of its own configuration, made as the agent makes its own."""
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import ApiClient, Configuration

    configuration = Configuration()
    await kube_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return await without_env_lookups(ApiClient(configuration))


async def request(api: Any, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One API request as JSON; RuntimeError naming the request and the answer unless 2xx."""
    response: Any = await api.call_api(
        path,
        method,
        header_params={"Accept": "application/json", "Content-Type": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=_TIMEOUT_S,
    )
    response = response[0] if isinstance(response, tuple) else response
    try:
        status, data = response.status, await response.read()
    finally:
        response.release()
    if not 200 <= status <= 299:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:500]!r}")
    return dict(json.loads(data))


def claim_object(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{RESOURCE_VERSION}",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {
            "devices": {"requests": [device_request(CHANNEL_REQUEST, CHANNEL_DEVICE_CLASS, RESOURCE_VERSION)]}
        },
    }


def allocation(node: str, domain_uid: str) -> dict[str, Any]:
    """``status.allocation`` as kube-scheduler writes it for the channel on `node`."""
    return {
        "devices": {
            "results": [
                {"request": CHANNEL_REQUEST, "driver": DRIVER_NAME, "pool": node, "device": CHANNEL_DEVICE}
            ],
            "config": [
                {
                    "source": "FromClaim",
                    "requests": [CHANNEL_REQUEST],
                    "opaque": {"driver": DRIVER_NAME, "parameters": channel_config(domain_uid)},
                }
            ],
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }


async def create_allocated_claims(
    api: Any, namespace: str, names: list[str], node: str, domain_uid: str, concurrency: int = 16
) -> list[str]:
    """Create the namespace and one allocated claim per name; their UIDs, in the order of `names`."""
    await request(api, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str) -> str:
        async with gate:
            created = await request(
                api,
                "POST",
                resource_path(RESOURCE_VERSION, "resourceclaims", namespace),
                claim_object(namespace, name),
            )
            created["status"] = {"allocation": allocation(node, domain_uid)}
            path = resource_path(RESOURCE_VERSION, "resourceclaims", namespace, name) + "/status"
            await request(api, "PUT", path, created)
            return str(created["metadata"]["uid"])

    return list(await asyncio.gather(*(one(n) for n in names)))


async def get_floor(api: Any, namespace: str, name: str, calls: int) -> list[float]:
    """`calls` GETs of one claim, one at a time, as the agent's claim source makes them; the latencies (s)."""
    path = resource_path(RESOURCE_VERSION, "resourceclaims", namespace, name)
    for _ in range(20):  # warm-up: the connection
        await request(api, "GET", path)
    latencies: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        await request(api, "GET", path)
        latencies.append(time.perf_counter() - start)
    return latencies
