"""The suite's benchmark of the node agent at the load kubelet makes: one call in flight, bursts of
4, the 16-in-flight capacity, and the floors measured beside them (tools/bench/nodeagent_prepare.py)."""

from __future__ import annotations

from tools.bench.benchmark import Benchmark, Extra, Metric, at

_PREPARE_SETUP = (
    "timed at the client over the DRA unix socket of a node-agent process whose node already runs a "
    "READY IMEX daemon for the domain, one claim per call; the claim read as Kubernetes mode reads "
    "it (a GET of the ResourceClaim from a real kube-apiserver, its etcd fsynced on disk), simulated "
    "hardware, our etcd on loopback with its data on disk (fsynced), the kubelet dir with the "
    "checkpoint on disk, saved as the agent ships (checkpoint_fsync false: atomic rename without "
    "fsync), the CDI root on tmpfs as /var/run/cdi is on a node"
)


_PREPARE_QUICK: tuple[str, ...] = ("--calls", "10", "--bursts", "3", "--capacity-calls", "32")
_PREPARE_QUICK += ("--floor-calls", "10", "--claim-source", "store")

PREPARE = Benchmark(
    name="nodeagent_prepare",
    module="tools.bench.nodeagent_prepare",
    full_args=("--calls", "500", "--bursts", "200", "--capacity-calls", "1000", "--floor-calls", "500"),
    # The quick smoke reads claims from the store: a kube-apiserver of its own would add its start.
    quick_args=_PREPARE_QUICK,
    full_timeout_s=600,
    quick_timeout_s=90,
    summary="NodePrepareResources / NodeUnprepareResources on a ready node, at the loads kubelet makes",
    metrics=(
        Metric(
            "prepare_p99_ms",
            "ms",
            "≤ 5 ms",
            5.0,
            True,
            at("sequential", "prepare", "p99_ms"),
            "99th percentile of NodePrepareResources with one call in flight (kubelet starting one "
            f"pod; 4 claims held besides the anchor), {_PREPARE_SETUP}. Bounded below by the floors "
            "beside it: an empty-handler DRA call, one fsynced etcd transaction, one claim GET.",
            {"calls_in_flight": 1},
            floor="floor_dra_call_p99_ms",
        ),
        Metric(
            "unprepare_p99_ms",
            "ms",
            "≤ 5 ms",
            5.0,
            True,
            at("sequential", "unprepare", "p99_ms"),
            "Same for NodeUnprepareResources (the node keeps the domain: another claim holds it).",
            {"calls_in_flight": 1},
            floor="floor_etcd_txn_p99_ms",
        ),
        Metric(
            "prepare_burst4_p99_ms",
            "ms",
            "≤ 10 ms",
            10.0,
            True,
            at("burst", "prepare", "p99_ms"),
            "4 pods starting together, then idle: 4 NodePrepareResources sent at once, then 0.1 s "
            "idle (then their unprepares, idle again), 200 bursts; per burst the latency of its last "
            "call from the burst's start; the 99th percentile of those.",
            {"calls_in_flight": "bursts of 4, idle 0.1 s between"},
            floor="floor_dra_call_p99_ms",
        ),
        Metric(
            "unprepare_burst4_p99_ms",
            "ms",
            "≤ 10 ms",
            10.0,
            True,
            at("burst", "unprepare", "p99_ms"),
            "Same for the bursts' 4 NodeUnprepareResources.",
            {"calls_in_flight": "bursts of 4, idle 0.1 s between"},
            floor="floor_etcd_txn_p99_ms",
        ),
        Metric(
            "prepare_capacity_per_s",
            "calls/s",
            "≥ 500/s",
            500.0,
            False,
            at("capacity", "calls_per_s"),
            "Capacity: 16 calls always in flight over one connection (each of 16 callers prepares "
            "its next claim, then unprepares the one before; 1,000 claims): NodePrepareResources "
            "and NodeUnprepareResources calls answered per second, both kinds counted.",
            {"calls_in_flight": 16},
        ),
    ),
    extras=(
        Extra(
            "floor_dra_call_p99_ms",
            "ms",
            at("floors", "dra_call", "p99_ms"),
            "Floor, same run: NodePrepareResources with one claim to a server with an empty handler "
            "on the agent's gRPC stack (grpclib + betterproto over a unix socket, its own process), "
            "one call in flight, from the same client; p99 of 500.",
        ),
        Extra(
            "floor_etcd_txn_p99_ms",
            "ms",
            at("floors", "etcd_txn", "p99_ms"),
            "Floor, same run: one fsynced etcd transaction (a guarded put of a claim-sized record, "
            "as the agent's record write) through the project's store client, one in flight, on "
            "the agent's etcd; p99 of 500.",
        ),
        Extra(
            "floor_kube_get_p99_ms",
            "ms",
            at("floors", "kube_get", "p99_ms"),
            "Floor, same run: one GET of a ResourceClaim from the kube-apiserver (kubernetes-asyncio, "
            "as the agent's claim source makes it), one in flight; p99 of 500.",
        ),
        Extra(
            "prepare_p50_ms",
            "ms",
            at("sequential", "prepare", "p50_ms"),
            "NodePrepareResources, one call in flight: the median.",
        ),
        Extra(
            "prepare_cpu_ms_per_call",
            "ms",
            at("sequential", "cpu_ms_per_call", "plugin_loop"),
            "CPU of the node agent's event-loop thread per call, one call in flight (prepare and "
            "unprepare alike, from /proc): the one thread every call passes through.",
        ),
        Extra(
            "prepare_p99_ms_16_in_flight",
            "ms",
            at("capacity", "prepare", "p99_ms"),
            "The capacity loop's NodePrepareResources p99 (16 in flight; the target before kubelet's "
            "real load was measured).",
        ),
        Extra(
            "dra_loop_cpu_ms_per_call",
            "ms",
            at("capacity", "cpu_ms_per_call", "plugin_loop"),
            "CPU of the node agent's event-loop thread per call in the capacity loop.",
        ),
        Extra(
            "dra_loop_floor_ms",
            "ms",
            at("capacity", "loop_floor_ms"),
            "16 calls always in flight times the loop thread's CPU per call: by Little's law no mean "
            "latency of the capacity loop's calls can be lower, on any number of idle cores.",
        ),
    ),
)
