"""The suite's benchmarks of scale: formation on a real Kubernetes control plane, and how cost grows
(tools/bench/formation_k8s.py, tools/bench/growth.py)."""

from __future__ import annotations

from collections.abc import Callable

from tools.bench.benchmark import Benchmark, Extra, Metric, Raw, at, get_path


def _k8s(*path: str | int) -> Callable[[Raw], float]:
    return at("formation", *path)


FORMATION_K8S = Benchmark(
    name="formation_k8s",
    module="tools.bench.formation_k8s",
    full_args=("--nodes", "256", "--racks", "15", "--reps", "3"),
    quick_args=("--nodes", "4", "--racks", "1", "--reps", "1"),
    # Start-up of 256 nodes, three formations and teardowns, and between formations the wait for
    # the advisor's reservations of the deleted domain to expire (their TTL, 300 s).
    full_timeout_s=3000,
    quick_timeout_s=240,
    summary="ComputeDomain formation on a real Kubernetes control plane (Indexed Job, scheduler extender, kubelet shim)",
    metrics=(
        Metric(
            "k8s_formation_256_s",
            "s",
            "≤ 30 s",
            30.0,
            True,
            _k8s("formation_p50_s"),
            "A real kube-apiserver, kube-controller-manager and kube-scheduler (with the placement "
            "advisor's extender, nodeCacheCapable as shipped, percentageOfNodesToScore 100 so "
            "that the extender sees every free node; client QPS 100 for it and the controller "
            "manager) on loopback, their etcd fsyncing on disk; our etcd, a "
            "cd-controller in Kubernetes mode and the advisor; 256 Nodes over 15 racks of simulated "
            "NVL72 hardware played by the kubelet shim, their IMEX agents and kubelet plugins in "
            "scale-mode hosts in Kubernetes mode (claims read from the API server, a ResourceSlice "
            "and clique label per node). The ComputeDomain (numNodes 256) is created and its "
            "ResourceClaimTemplate awaited; then from creating an Indexed Job of 256 pods (all in "
            "parallel, each claiming the channel through the template) until every pod is Running "
            "(the shim marks it so once NodePrepareResources answered for its claim) and the "
            "ComputeDomain's status is Ready with 256 nodes, both seen through API watches. "
            "Median of the repetitions.",
            floor="k8s_job_256_s",
        ),
        Metric(
            "k8s_formation_256_ratio",
            "x",
            "≤ 1.5",
            1.5,
            True,
            _k8s("ratio_to_plain_job"),
            "k8s_formation_256_s divided by k8s_job_256_s (both medians of the same run): what the "
            "ComputeDomain costs on top of Kubernetes' own time for the Job.",
        ),
        Metric(
            "k8s_writes_per_node",
            "writes/node",
            "≤ 2 per node",
            2.0,
            True,
            _k8s("writes_per_node_max"),
            "Same formations: API server writes (create, update, patch, delete) made by our "
            "components (the cd-controller, the node agents), counted in the API server's audit "
            "log by user agent from the ComputeDomain's creation until 3 s after the formation "
            "was done, divided by the nodes; the largest count of the repetitions.",
        ),
    ),
    extras=(
        Extra(
            "k8s_job_256_s",
            "s",
            _k8s("plain_job_p50_s"),
            "Floor, same run: the same Indexed Job of 256 pods on the same control plane (the "
            "extender consulted as shipped) and shim nodes, without a ComputeDomain (its pods claim "
            "nothing), created just before each formation: from creating it until every pod is "
            "Running, seen through an API watch. Median of the repetitions.",
        ),
        Extra(
            "k8s_formation_256_scheduled_s",
            "s",
            _k8s("scheduled_p50_s"),
            "Kubernetes formation: Job created → the last pod bound to a node (median).",
        ),
        Extra(
            "k8s_formation_256_prepared_s",
            "s",
            _k8s("prepared_p50_s"),
            "Kubernetes formation: Job created → the last pod Running (its claim prepared; median).",
        ),
        Extra(
            "k8s_formation_256_ready_s",
            "s",
            _k8s("ready_p50_s"),
            "Kubernetes formation: Job created → the ComputeDomain Ready (median).",
        ),
        Extra(
            "k8s_apiserver_writes_per_node_all",
            "writes/node",
            lambda raw: (
                float(get_path(raw, "formation", "formations", 0, "writes", "all"))
                / float(get_path(raw, "formation", "nodes"))
            ),
            "Kubernetes formation: every component's API server writes in the same window, per node "
            "(the scheduler's bindings and allocations, the controller manager's pods and claims, "
            "the kubelet shim's pod status and node leases, ours), first repetition.",
        ),
        Extra(
            "k8s_teardown_256_s",
            "s",
            _k8s("teardown_p50_s"),
            "Kubernetes formation: Job deleted → pods and claims gone, then ComputeDomain deleted → "
            "gone (its finalizer released) and no IMEX daemon left (median).",
        ),
    ),
)


def _growth_size(key: str, size_key: str, size: int, value: str) -> Callable[[Raw], float]:
    def extract(raw: Raw) -> float:
        for point in raw[key]["sizes"]:
            if int(point[size_key]) == size:
                return float(point[value])
        raise KeyError(f"no {key} point at {size_key} {size}")

    return extract


GROWTH = Benchmark(
    name="growth",
    module="tools.bench.growth",
    full_args=("--nodes", "18,72,256,1008", "--reps-large", "3", "--domains", "100,1000,5000"),
    quick_args=("--nodes", "4,8", "--reps", "1", "--domains", "20,60", "--churn-seconds", "2"),
    full_timeout_s=5400,
    quick_timeout_s=300,
    summary="How cost grows: formation time against nodes, controller CPU per store event against domains",
    metrics=(
        Metric(
            "formation_1008_s",
            "s",
            "≤ 30 s",
            30.0,
            True,
            at("formation", "largest_ready_p50_s"),
            "The formation of formation_256_s (simulation: scale-mode hosts, one cd-controller, "
            "private etcd, plaintext mesh) for one job of 1,008 nodes over 56 racks (56 IMEX "
            "cliques, 1,008 daemon processes): from writing the domain and claims to the domain "
            "Ready; the median of 3 formations, each torn down before the next.",
        ),
        Metric(
            "growth_formation_top_exponent",
            "exponent",
            "≤ 1.0 (linear or better)",
            1.0,
            True,
            at("formation", "fit", "top_exponent"),
            "Formation time ~ nodes^k: the log-log slope between the two largest sizes (256 and "
            "1,008 nodes, each its median), the growth the fit over all sizes hides.",
        ),
    ),
    extras=(
        *(
            Extra(
                f"growth_formation_{n}_s",
                "s",
                _growth_size("formation", "nodes", n, "ready_p50_s"),
                f"Growth curve: formation of {n} nodes ({max(1, -(-n // 18))} racks), submit → Ready (median).",
            )
            for n in (18, 72, 256)
        ),
        Extra(
            "growth_formation_exponent",
            "",
            at("formation", "fit", "exponent"),
            "Formation time ~ nodes^k, k fitted by least squares on log-log axes over the sizes "
            "(k ≤ 1: linear or better).",
        ),
        Extra(
            "formation_1008_spread_s",
            "s",
            at("formation", "largest_ready_spread_s"),
            "formation_1008_s: the slowest of its runs minus the fastest (each run is in the raw "
            "results, formation.largest_ready_runs_s).",
        ),
        *(
            Extra(
                f"controller_cpu_ms_per_event_{d}",
                "ms",
                _growth_size("controller", "domains", d, "cpu_ms_per_event"),
                f"One cd-controller over {d:,} formed domains of 4 members (and 25 % more nodes than "
                "members): its CPU time (user + system) from the start of 15 s of churn by 32 drivers "
                "until it caught up, per store event it handled.",
            )
            for d in (100, 1000, 5000)
        ),
        Extra(
            "growth_controller_cpu_per_event_exponent",
            "",
            at("controller", "fit", "exponent"),
            "Controller CPU per event ~ domains^k, fitted likewise (k ≤ 0: its total work grows no "
            "faster than the events it handles).",
        ),
        Extra(
            "growth_controller_cpu_per_event_top_exponent",
            "",
            at("controller", "fit", "top_exponent"),
            "Controller CPU per event: the log-log slope between the two largest sizes (1,000 and 5,000 domains).",
        ),
    ),
)
