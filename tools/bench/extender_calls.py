"""kube-scheduler's calls to the advisor's extender, as tools/bench/advisor_grpc.py times them.

kube-scheduler calls an extender one request at a time with ExtenderArgs JSON: the pod and either
the candidate names (nodeCacheCapable) or whole v1.Node objects, the feasible nodes it found. Pods
belong to ComputeDomains seeded here; a first Filter per domain (untimed) reserves its nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import statistics
import sys
import time
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench.advisor_process import AdvisorProcess, wait_quiet
from tools.bench.stats import percentile
from tools.sim.hardware.cluster import ClusterDescription

NAMESPACE = "bench"


def feasible_nodes_to_find(nodes: int) -> int:
    """How many feasible nodes kube-scheduler looks for (and sends extenders) with its default
    adaptive percentageOfNodesToScore (numFeasibleNodesToFind in pkg/scheduler/schedule_one.go)."""
    if nodes < 100:
        return nodes
    percentage = max(50 - nodes // 125, 5)
    return max(nodes * percentage // 100, 100)


async def seed_domains(endpoint: str, prefix: str, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` ComputeDomains (uid, workload template name) of 2-18 nodes, as the controller
    mirrors them: the extender finds a pod's domain by its claim template."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    async with Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=30.0)) as store:
        for k in range(count):
            uid, template = f"bench-cd-{k}", f"cd-{k}-channel"
            domain = pb.ComputeDomain(
                uid=uid,
                namespace=NAMESPACE,
                name=f"cd-{k}",
                spec=pb.ComputeDomainSpec(
                    num_nodes=rng.choice([2, 4, 8, 16, 18]),
                    channel=pb.ChannelSpec(resource_claim_template_name=template),
                ),
            )
            await store.put(store.keys.domain(uid), domain)
            out.append((uid, template))
    return out


def pod_object(domain: int, template: str, replica: int) -> dict[str, Any]:
    """A worker pod of a ComputeDomain job as kube-scheduler serialises it (v1.Pod)."""
    name = f"cd-{domain}-worker-{replica}"
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"00000000-0000-4000-8000-{domain:06d}{replica:06d}",
            "labels": {"app": f"cd-{domain}", "job-name": f"cd-{domain}-worker"},
            "annotations": {},
        },
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "command": ["torchrun", "--nnodes", "4", "train.py"],
                    "resources": {
                        "limits": {"nvidia.com/gpu": "4"},
                        "claims": [{"name": "imex-channel"}],
                    },
                }
            ],
            "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": template}],
            "schedulerName": "default-scheduler",
            "restartPolicy": "Never",
        },
        "status": {"phase": "Pending"},
    }


def node_object(name: str, clique: str, address: str) -> dict[str, Any]:
    """A GB200 node as kube-scheduler serialises it (v1.Node): labels from the GPU operator's
    feature discovery, capacity, conditions and a short image list."""
    gpu_labels = {
        "nvidia.com/gpu.clique": clique,
        "nvidia.com/gpu.product": "NVIDIA-GB200",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.memory": "189471",
        "nvidia.com/gpu.family": "blackwell",
        "nvidia.com/gpu.machine": "GB200-NVL72",
        "nvidia.com/cuda.driver-version.full": "570.124.06",
        "nvidia.com/cuda.runtime-version.full": "12.8",
        "nvidia.com/gpu.deploy.driver": "true",
        "nvidia.com/gpu.present": "true",
    }
    conditions = [
        {
            "type": kind,
            "status": "True" if kind == "Ready" else "False",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "reason": f"Kubelet{kind}",
            "message": f"kubelet reports {kind}",
        }
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
    ]
    images = [
        {
            "names": [f"nvcr.io/nvidia/image-{i}@sha256:{i:064x}", f"nvcr.io/nvidia/image-{i}:25.01"],
            "sizeBytes": 10**9,
        }
        for i in range(8)
    ]
    resources = {
        "cpu": "144",
        "memory": "898Gi",
        "pods": "110",
        "ephemeral-storage": "3500Gi",
        "nvidia.com/gpu": "4",
        "hugepages-2Mi": "0",
    }
    return {
        "metadata": {
            "name": name,
            "uid": f"node-{name}",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "arm64",
                "node.kubernetes.io/instance-type": "gb200-nvl72",
                "topology.kubernetes.io/zone": "zone-a",
                **gpu_labels,
            },
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"podCIDR": "10.244.0.0/24", "providerID": f"bench://{name}"},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": name,
                "kernelVersion": "6.8.0-1021-nvidia-64k",
                "osImage": "Ubuntu 24.04.1 LTS",
                "containerRuntimeVersion": "containerd://1.7.24",
                "kubeletVersion": "v1.33.1",
                "operatingSystem": "linux",
                "architecture": "arm64",
            },
            "images": images,
        },
    }


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> bytes:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"extender {path}: HTTP {resp.status}: {data[:300]!r}")
    return data


def bench_extender(
    advisor: AdvisorProcess, endpoint: str, prefix: str, args: argparse.Namespace
) -> dict[str, Any]:
    """p50/p99 of Filter and Prioritize, for node names and for whole Node objects."""
    port = advisor.extender_port
    cluster = ClusterDescription(racks=args.racks, seed=f"grpc-bench-{args.seed}")
    nodes = {n.name: n for n in cluster.nodes()}
    names = list(nodes)
    candidates = min(args.extender_candidates or feasible_nodes_to_find(len(names)), len(names))
    domains = asyncio.run(seed_domains(endpoint, prefix, args.extender_domains, args.seed))
    rng = random.Random(args.seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    # First pod of each domain, untimed: the extender reserves the domain's nodes.
    held: list[list[str]] = []
    for k, (_, template) in enumerate(domains):
        body = json.dumps({"Pod": pod_object(k, template, 0), "Nodes": None, "NodeNames": names}).encode()
        reply = json.loads(_post(conn, "/filter", body))
        if reply["Error"] or not reply["NodeNames"]:
            failed = {**(reply["FailedNodes"] or {}), **(reply["FailedAndUnresolvableNodes"] or {})}
            why = reply["Error"] or next(iter(failed.values()), "no candidate was kept")
            raise RuntimeError(
                f"ComputeDomain cd-{k}: the Filter of its first pod kept no node: {why}. With "
                f"--racks {args.racks} --busy {args.busy} its nodes may not be free in one clique: "
                "lower --busy or add racks"
            )
        held.append(list(reply["NodeNames"]))
    bodies: dict[str, list[bytes]] = {"node_names": [], "nodes": []}
    sizes: dict[str, list[int]] = {"node_names": [], "nodes": []}
    for j in range(args.extender_bodies):
        k = j % len(domains)
        mine = set(held[k])
        others = rng.sample([n for n in names if n not in mine], candidates - len(mine))
        chosen = held[k] + others
        rng.shuffle(chosen)
        pod = pod_object(k, domains[k][1], 1 + j)
        for payload in bodies:
            if payload == "node_names":
                args_obj: dict[str, Any] = {"Pod": pod, "Nodes": None, "NodeNames": chosen}
            else:
                items = [node_object(n, nodes[n].clique, nodes[n].address) for n in chosen]
                args_obj = {"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": None}
            body = json.dumps(args_obj).encode()
            bodies[payload].append(body)
            sizes[payload].append(len(body))
    out: dict[str, Any] = {
        "candidates": candidates,
        "domains": len(domains),
        "calls": args.extender_calls,
        "body_kb": {p: round(statistics.fmean(v) / 1024, 1) for p, v in sizes.items()},
        # Waited for the advisor and etcd to be idle (the gRPC phases' work digested) first.
        "settled_s": wait_quiet(advisor),
    }
    for verb in ("filter", "prioritize"):
        for payload, payload_bodies in bodies.items():
            latencies: list[float] = []
            cpu0 = etcd0 = 0.0
            for call in range(args.extender_calls + 5):
                if call == 5:
                    cpu0, etcd0 = advisor.cpu_seconds(), advisor.etcd_cpu_seconds()
                body = payload_bodies[call % len(payload_bodies)]
                t0 = time.perf_counter()
                reply = _post(conn, f"/{verb}", body)
                elapsed = time.perf_counter() - t0
                if call < 5:
                    continue  # warm-up: the body's first parse, caches
                latencies.append(elapsed)
                if verb == "filter" and b'"Error": ""' not in reply and b'"Error":""' not in reply:
                    raise RuntimeError(f"extender filter answered an error: {reply[:300]!r}")
            out[f"{verb}_{payload}"] = {
                "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
                "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
                "max_ms": round(max(latencies) * 1e3, 3),
                "mean_ms": round(statistics.fmean(latencies) * 1e3, 3),
                # What the advisor and etcd spent per timed call.
                "advisor_cpu_ms_per_call": round((advisor.cpu_seconds() - cpu0) / len(latencies) * 1e3, 3),
                "etcd_cpu_ms_per_call": round((advisor.etcd_cpu_seconds() - etcd0) / len(latencies) * 1e3, 3),
            }
            print(f"extender {verb} {payload}: {json.dumps(out[f'{verb}_{payload}'])}", file=sys.stderr)
    conn.close()
    return out
