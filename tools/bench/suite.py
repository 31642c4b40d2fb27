"""The benchmark suite and the project's targets: which scripts run, with which arguments, and what each metric is.

Each benchmark is a module under ``tools.bench`` run as its own process with ``--out <file>``;
each metric is read out of that file, with the settings it was measured at (the benchmark's own
``settings`` object, plus the metric's: which RPC shape, which payload). A metric is one
measurement of one configuration, never the better of several. Full arguments are the measurement of record; quick ones
(``make bench`` ``--quick``, CI smoke) shrink sizes and repetitions so the whole suite runs in
a few minutes, and their figures say nothing about the targets.
"""

from __future__ import annotations

from collections.abc import Callable

from tools.bench.benchmark import Benchmark, Extra, Metric, Raw, at, get_path, own_settings
from tools.bench.kubelet_load import PREPARE
from tools.bench.scaling import FORMATION_K8S, GROWTH

__all__ = ["REQUIRED_METRICS", "SUITE", "Benchmark", "Extra", "Metric", "Raw", "own_settings"]


def _largest_size(raw: Raw) -> Raw:
    sizes: list[Raw] = list(raw["sizes"])
    if not sizes:
        raise ValueError("the packing benchmark reported no cluster size")
    return max(sizes, key=lambda s: int(s["nodes"]))


def _formation_large(raw: Raw) -> float:
    return float(get_path(raw, "formation_256", "ready_p50_s"))


_FORMATION_FULL = ("--reps", "10", "--nodes-256", "256", "--racks-256", "15", "--reps-256", "3")
_FORMATION_QUICK = ("--reps", "2", "--nodes-256", "12", "--racks-256", "2", "--reps-256", "1")

FORMATION = Benchmark(
    name="formation",
    module="tools.bench.formation",
    # The targets are the formation's own work: daemons that trust each other's addresses (the
    # plaintext mesh). Mutual TLS adds every daemon's handshakes with its 17 peers, which on real
    # hardware run on 256 machines and here share this one: FORMATION_TLS reports it beside.
    full_args=(*_FORMATION_FULL, "--mesh", "plaintext"),
    quick_args=(*_FORMATION_QUICK, "--mesh", "plaintext"),
    full_timeout_s=1200,
    quick_timeout_s=150,
    summary="ComputeDomain formation through the scale-mode host, the controller and etcd (plaintext IMEX mesh)",
    metrics=(
        Metric(
            "formation_18_p50_s",
            "s",
            "≤ 1.0 s",
            1.0,
            True,
            lambda raw: float(get_path(raw, "formation_18", "ready_p50_s")),
            "Median over repetitions of: ComputeDomain and 18 allocated channel claims written to the store "
            "(t0) → NodePrepareResources on each node's DRA socket, all at once, kubelet-style retries "
            "(a prepare answers once the node joined and its IMEX daemon is READY) → the controller's "
            "status.status Ready (every daemon connected to its 17 peers), seen through a store watch. "
            "One rack, both node programs per node in the scale-mode host (their own composition "
            "roots, one simulated IMEX daemon process per node), one cd-controller process, private etcd "
            "(data on disk, fsynced). The job is deleted "
            "and fully torn down between repetitions.",
        ),
        Metric(
            "formation_256_s",
            "s",
            "≤ 10 s",
            10.0,
            True,
            _formation_large,
            "Same measurement for one job of 256 nodes over 15 racks (17-18 nodes per rack, 15 IMEX "
            "cliques, 256 daemon processes): from writing the domain and claims to the domain Ready "
            "(median of the repetitions).",
        ),
    ),
    extras=(
        Extra(
            "formation_18_prepared_p50_s",
            "s",
            lambda raw: float(get_path(raw, "formation_18", "prepared_p50_s")),
            "18-node formation: t0 → the last NodePrepareResources answered (median).",
        ),
        Extra(
            "formation_256_prepared_s",
            "s",
            lambda raw: float(get_path(raw, "formation_256", "prepared_p50_s")),
            "256-node job: t0 → the last NodePrepareResources answered (median).",
        ),
        Extra(
            "formation_256_host_rss_mb",
            "MB",
            lambda raw: float(get_path(raw, "formation_256", "host", "rss_mb")),
            "Resident memory of the scale-mode host running the 256 agents (daemons are processes of their own).",
        ),
        Extra(
            "formation_256_max_loop_lag_s",
            "s",
            lambda raw: float(get_path(raw, "formation_256", "host", "max_loop_lag_s")),
            "Largest event-loop delay of the scale-mode host (every hosted agent shares it).",
        ),
    ),
)

ADVISOR_PACKING = Benchmark(
    name="advisor_packing",
    module="tools.bench.advisor_packing",
    full_args=(),
    quick_args=("--jobs-1k", "1500", "--jobs-10k", "0", "--policies", "BEST_FIT,FIRST_FIT"),
    full_timeout_s=900,
    quick_timeout_s=120,
    plot_arg="--plot",
    plot_name="advisor_stranded.png",
    summary="Placement quality of the advisor's policies on a seeded trace",
    metrics=(
        Metric(
            "advisor_stranded_vs_first_fit",
            "fraction",
            "≥ 0.30 (30 % fewer stranded nodes)",
            0.30,
            False,
            lambda raw: float(get_path(_largest_size(raw), "verdict", "stranded_reduction_vs_first_fit")),
            "Reference trace replayed on ~10,000 nodes against the default policy (BEST_FIT) and FIRST_FIT "
            "through the advisor's real decision path: 1 - stranded(BEST_FIT) / stranded(FIRST_FIT), where "
            "stranded = free healthy nodes in cliques whose free count is below the trace's median "
            "single-clique job, averaged over the steady state.",
        ),
        Metric(
            "advisor_single_clique_fit_rate",
            "fraction",
            "≥ 0.99",
            0.99,
            False,
            lambda raw: float(get_path(_largest_size(raw), "results", "BEST_FIT", "single_clique_fit_rate")),
            "Same replay: placed jobs of ≤ 18 nodes that got a single clique / all placed jobs of ≤ 18 "
            "nodes (BEST_FIT, ~10,000 nodes).",
        ),
    ),
)

_SHAPES = {"stream": "PlaceStream", "unary": "Place (unary)"}
_PAYLOADS = {
    "node_names": "nodeCacheCapable: node names only",
    "nodes": "not nodeCacheCapable: whole v1.Node objects",
}


def _ladder_at(shape: str, rate: float, key: str) -> Callable[[Raw], float]:
    """A figure of the reserving open loop at `rate` of the capacity search."""

    def extract(raw: Raw) -> float:
        for phase in get_path(raw, "shapes", shape, "reserve_ladder"):
            if float(phase["offered_per_s"]) == rate:
                return float(phase[key])
        raise KeyError(f"no reserving phase at {rate:g}/s")

    return extract


_ADVISOR_SETUP = (
    "a cd-placement-advisor process following a store of 10,008 nodes (70 % bound to domains); a "
    "client process sends Place requests open-loop (on a schedule, whatever the answers: latency "
    "from the scheduled send time, no coordinated omission)"
)


def _advisor_metrics() -> tuple[Metric, ...]:
    """One metric per RPC shape and per extender payload: each configuration on its own."""
    out: list[Metric] = []
    for shape, rpc in _SHAPES.items():
        out += [
            Metric(
                f"advisor_p99_ms_10k_{shape}",
                "ms",
                "≤ 1 ms at 200/s",
                1.0,
                True,
                at("shapes", shape, "open_loop", "p99_ms"),
                f"{rpc}: {_ADVISOR_SETUP}, dry runs (a decision, no write) at 200 decisions/s for "
                "20 s (schedulers make 40-100 pod placements/s); p99 of the latency.",
                {"rpc": rpc, "reservation": "none (dry run)", "offered_per_s": 200},
            ),
            Metric(
                f"advisor_reserve_p99_ms_10k_{shape}",
                "ms",
                "≤ 10 ms at 100/s",
                10.0,
                True,
                at("shapes", shape, "open_loop_reserve", "p99_ms"),
                f"{rpc}: the same at 100 decisions/s for 20 s with reserve=true, as a scheduler "
                "places: each answer comes after its reservation (a lease and a guarded transaction) "
                "is written to etcd. The client releases each reservation as its answer arrives "
                "(untimed, same advisor and etcd). Beside it, etcd's put p99 in the same run.",
                {
                    "rpc": rpc,
                    "reservation": "written to etcd, released after the answer",
                    "offered_per_s": 100,
                },
                floor=f"advisor_etcd_put_p99_ms_{shape}",
            ),
            Metric(
                f"advisor_decisions_per_s_10k_{shape}",
                "decisions/s",
                "≥ 2,000/s",
                2000.0,
                False,
                at("shapes", shape, "saturation", "decisions_per_s"),
                f"{rpc}: same set-up, dry-run, closed loop with 16 requests in flight: the decisions/s "
                "the advisor sustains.",
                {"rpc": rpc, "reservation": "none (dry run)"},
            ),
        ]
    out.append(
        Metric(
            "advisor_reserve_capacity_per_s_10k",
            "decisions/s",
            "≥ 500/s with p99 ≤ 250 ms",
            500.0,
            False,
            at("shapes", "stream", "reserve_capacity_per_s"),
            f"PlaceStream: {_ADVISOR_SETUP}, reserving (as advisor_reserve_p99_ms_10k_stream) for 8 s at "
            "each of 250, 500, 1,000, 1,500 and 2,000 decisions/s offered; the decisions/s answered at "
            "the highest rate that was answered in full (97 %) with p99 ≤ 250 ms.",
            {"rpc": "PlaceStream", "reservation": "written to etcd, released after the answer"},
        )
    )
    for verb in ("filter", "prioritize"):
        for payload, what in _PAYLOADS.items():
            out.append(
                Metric(
                    f"extender_{verb}_p99_ms_10k_{payload}",
                    "ms",
                    "≤ 10 ms",
                    10.0,
                    True,
                    at("extender", f"{verb}_{payload}", "p99_ms"),
                    f"The advisor's kube-scheduler extender, {verb.capitalize()} verb over HTTP, one call at "
                    f"a time as kube-scheduler makes them, ExtenderArgs with the pod and the candidates "
                    f"({what}): the 500 feasible nodes kube-scheduler sends at 10,008 nodes with its "
                    "default percentageOfNodesToScore, among them the pod's ComputeDomain's reserved "
                    "nodes. p99 at the client, from sending the body to the whole answer read.",
                    {"verb": verb, "payload": what},
                )
            )
    return tuple(out)


ADVISOR_GRPC = Benchmark(
    name="advisor_grpc",
    module="tools.bench.advisor_grpc",
    full_args=(),
    quick_args=(
        *("--racks", "56", "--seconds", "0.5", "--target-seconds", "0.5", "--extender-calls", "20"),
        *("--reserve-rates", "2000", "--floor-puts", "50"),
    ),
    # Nine phases per RPC shape (two of 20 s), the extender's calls, on a machine maybe shared.
    full_timeout_s=1200,
    quick_timeout_s=150,
    summary="Placement through the advisor at 10,000 nodes: gRPC decisions, reservations, the scheduler extender",
    metrics=_advisor_metrics(),
    extras=tuple(
        extra
        for shape, rpc in _SHAPES.items()
        for extra in (
            Extra(
                f"advisor_etcd_put_p99_ms_{shape}",
                "ms",
                at("shapes", shape, "etcd_put", "p99_ms"),
                f"{rpc} run: etcd's put p99 beside the reserving phase (500 puts of 512 bytes, one at a "
                "time, the advisor's etcd, fsynced): the floor of any reservation's write.",
                {"rpc": rpc},
            ),
            Extra(
                f"advisor_p99_ms_10k_{shape}_at_2000",
                "ms",
                at("shapes", shape, "open_loop_capacity", "p99_ms"),
                f"{rpc}: dry runs open-loop at 2,000 decisions/s for 8 s (capacity report, no target).",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            Extra(
                f"advisor_reserve_p99_ms_10k_{shape}_at_2000",
                "ms",
                _ladder_at(shape, 2000.0, "p99_ms"),
                f"{rpc}: reserving open-loop at 2,000 decisions/s for 8 s (capacity report, no target).",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            Extra(
                f"advisor_reserve_achieved_per_s_10k_{shape}",
                "decisions/s",
                _ladder_at(shape, 2000.0, "decisions_per_s"),
                f"{rpc}: reserving decisions answered per second while 2,000/s were offered.",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            Extra(
                f"advisor_reserve_cpu_ms_per_decision_{shape}",
                "ms",
                _ladder_at(shape, 2000.0, "server_cpu_ms_per_decision"),
                f"{rpc}: the advisor process's CPU time per reserving decision at 2,000/s offered (the "
                "release included).",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            Extra(
                f"advisor_loop_busy_10k_{shape}",
                "fraction",
                at("shapes", shape, "open_loop_capacity", "loop_busy"),
                f"{rpc}: the share of the dry-run phase at 2,000/s that the advisor's event-loop thread "
                "spent on the CPU (every decision passes through it; the closer to 1, the longer the "
                "queue in front of it).",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            Extra(
                f"advisor_reserve_loop_busy_10k_{shape}",
                "fraction",
                _ladder_at(shape, 2000.0, "loop_busy"),
                f"{rpc}: the same share over the reserving phase at 2,000/s.",
                {"rpc": rpc, "offered_per_s": 2000},
            ),
            *(
                (
                    Extra(
                        "advisor_reserve_capacity_per_s_10k_unary",
                        "decisions/s",
                        at("shapes", "unary", "reserve_capacity_per_s"),
                        "advisor_reserve_capacity_per_s_10k for Place (unary).",
                        {"rpc": rpc},
                    ),
                )
                if shape == "unary"
                else ()
            ),
        )
    ),
)

CONTROLLER = Benchmark(
    name="controller_churn",
    module="tools.bench.controller_churn",
    full_args=(),
    quick_args=("--nodes", "1000", "--domains", "100", "--churn-seconds", "3", "--backlog-seconds", "3"),
    full_timeout_s=900,
    quick_timeout_s=150,
    summary="The domain controller under churn, and its memory with 10,000 nodes and 1,000 domains",
    metrics=(
        Metric(
            "controller_events_per_s_live",
            "events/s",
            "≥ 500/s",
            500.0,
            False,
            lambda raw: float(get_path(raw, "churn", "events_per_s")),
            "One cd-controller process over a store of 10,000 nodes and 1,000 domains that churn "
            "(deleted and formed again by 32 drivers playing users and node agents). Store events "
            "the controller handled per second (its own counter) while they churn live: bounded by "
            "what the drivers produce as well as by the controller.",
            {"phase": "live churn"},
        ),
        Metric(
            "controller_events_per_s_backlog",
            "events/s",
            "≥ 500/s",
            500.0,
            False,
            lambda raw: float(get_path(raw, "backlog", "events_per_s")),
            "Same store: the rate at which the controller works off a backlog of events built while "
            "it was stopped (its capacity).",
            {"phase": "backlog after a stop"},
        ),
        Metric(
            "controller_rss_mb_10k",
            "MB",
            "≤ 300 MB",
            300.0,
            True,
            lambda raw: float(get_path(raw, "rss_mb", "with_population")),
            "Resident memory of the controller once it has converged 10,000 node records and 1,000 "
            "domains of 4 members each to Ready.",
        ),
    ),
    extras=(
        Extra(
            "controller_rss_mb_peak",
            "MB",
            lambda raw: float(get_path(raw, "rss_mb", "peak_during_churn")),
            "Controller: peak resident memory during churn.",
        ),
    ),
)

SCALE_INVENTORY = Benchmark(
    name="scale_inventory",
    module="tools.bench.scale_inventory",
    full_args=("--racks", "556", "--hold-s", "20"),
    quick_args=("--racks", "14", "--hold-s", "2"),
    full_timeout_s=900,
    quick_timeout_s=90,
    summary="10,000 simulated nodes held by the scale-mode host",
    metrics=(),
    extras=(
        Extra(
            "scale_inventory_nodes",
            "nodes",
            lambda raw: float(get_path(raw, "node_records_after_hold")),
            "Node records on their own leases in the store after holding the inventory (556 racks: 10,008 "
            "inventory-only agents in one scale-mode host).",
        ),
        Extra(
            "scale_inventory_host_rss_mb",
            "MB",
            lambda raw: float(get_path(raw, "host_rss_mb")),
            "Resident memory of the scale-mode host holding those nodes.",
        ),
        Extra(
            "scale_inventory_controller_rss_mb",
            "MB",
            lambda raw: float(get_path(raw, "controller_rss_mb")),
            "Resident memory of a cd-controller following that inventory.",
        ),
        Extra(
            "scale_inventory_register_s",
            "s",
            lambda raw: float(get_path(raw, "register_all_s")),
            "Time until every node record was in the store (agents start 500 at a time).",
        ),
        Extra(
            "scale_inventory_lease_losses",
            "leases",
            lambda raw: float(get_path(raw, "lease_losses")),
            "Node leases lost while holding (each would make a node look dead; must be 0).",
        ),
    ),
)

FORMATION_TLS = Benchmark(
    name="formation_tls",
    module="tools.bench.formation",
    full_args=("--reps", "5", "--nodes-256", "256", "--racks-256", "15", "--reps-256", "2", "--mesh", "tls"),
    quick_args=(*_FORMATION_QUICK, "--mesh", "tls"),
    full_timeout_s=1200,
    quick_timeout_s=150,
    summary="The same formations with mutual TLS between the IMEX daemons (the default mesh)",
    metrics=(),
    extras=(
        Extra(
            "formation_18_tls_p50_s",
            "s",
            lambda raw: float(get_path(raw, "formation_18", "ready_p50_s")),
            "formation_18_p50_s with mutual TLS: each node's key, certificate request and signed "
            "certificate before its daemon starts, then TLS handshakes with its peers.",
        ),
        Extra(
            "formation_256_tls_s",
            "s",
            _formation_large,
            "formation_256_s with mutual TLS (256 daemons' handshakes on this machine's cores).",
        ),
    ),
)


def _mode_figure(mode: str, key: str) -> Callable[[Raw], float]:
    return lambda raw: float(get_path(raw, "modes", mode, key))


def _gang_extras() -> tuple[Extra, ...]:
    figures = (
        ("placed", "gangs", "gangs of the trace whose pods were all bound before the replay ended"),
        ("bind_p50_s", "s", "median time from a gang's Job created to all its pods bound"),
        ("bind_p99_s", "s", "99th percentile of the time from a gang's Job created to all its pods bound"),
        ("split", "gangs", "placed gangs whose pods were bound in more than one clique"),
        (
            "stranded_node_s",
            "node-s",
            "free nodes in cliques too small for the smallest waiting gang, integrated",
        ),
        ("partial_node_s", "node-s", "nodes held by bound pods of gangs not yet whole, integrated"),
        ("largest_free_block_mean", "nodes", "time average of the most free nodes in one clique"),
    )
    return tuple(
        Extra(
            f"placement_{mode}_{key}",
            unit,
            _mode_figure(mode, key),
            f"gang_placement, {mode}: {what}.",
        )
        # The extender's and plugin-gang's figures are in the benchmark's own JSON (the full run).
        for mode in ("native", "plugin")
        for key, unit, what in figures
    )


GANG_PLACEMENT = Benchmark(
    name="gang_placement",
    module="tools.bench.gang_placement",
    full_args=("--gangs", "40", "--seed", "7"),
    # Smoke only (about 45 s): 3 small gangs, apart in time on 8 nodes; the figures mean nothing.
    quick_args=(
        "--modes",
        "native,plugin",
        "--gangs",
        "3",
        "--trays",
        "4",
        "--mean-gap-s",
        "6",
        "--hold-min-s",
        "2",
        "--hold-max-s",
        "4",
    ),
    full_timeout_s=1800,
    quick_timeout_s=300,
    summary="Gang placement on a real control plane: kube-scheduler's native gang and topology scheduling "
    "against the advisor through cd-scheduler's plugin (and through the extender, and the plugin with a "
    "PodGroup), one trace",
    metrics=(
        Metric(
            "placement_stranded_vs_native",
            "fraction",
            "≥ 0.30 (30 % fewer stranded nodes than native)",
            0.30,
            False,
            lambda raw: float(raw["unusable_vs_native"]),
            "One seeded trace of 40 gangs (1 to 18 nodes, arriving with exponential gaps of mean 4 s, "
            "each holding its nodes 10 to 30 s once all its pods are bound) replayed on a real "
            "control plane (1.37) over 2 racks of 18 kubelet-shim nodes: by kube-scheduler's native gang "
            "and topology scheduling (a PodGroup per gang, topology nvidia.com/gpu.clique, no extender), "
            "then by the advisor through cd-scheduler (integrations/scheduler-plugin: one Place and "
            "Reserve per gang; the shipped configuration, no PodGroup). Stranded nodes: free nodes in cliques "
            "with fewer free nodes than the smallest gang waiting, plus nodes held by bound pods of gangs "
            "not yet whole (no waiting gang can use either), integrated over the time a gang waits "
            "(node-seconds, sampled every 0.25 s). Value: 1 - cd-scheduler's / native's (the "
            "extender's and plugin-gang's figures are in the benchmark's JSON).",
        ),
    ),
    extras=_gang_extras(),
)


SUITE: tuple[Benchmark, ...] = (
    FORMATION,
    FORMATION_TLS,
    FORMATION_K8S,
    PREPARE,
    ADVISOR_PACKING,
    ADVISOR_GRPC,
    CONTROLLER,
    SCALE_INVENTORY,
    GROWTH,
    GANG_PLACEMENT,
)

# Metrics the committed results must hold. New metrics join once a run of record measured them;
# until then the report lists them as not measured.
REQUIRED_METRICS = (
    "formation_18_p50_s",
    "formation_256_s",
    "prepare_p99_ms",
    "unprepare_p99_ms",
    *(m.name for m in ADVISOR_GRPC.metrics if m.name != "advisor_reserve_capacity_per_s_10k"),
    "advisor_stranded_vs_first_fit",
    "advisor_single_clique_fit_rate",
    "controller_events_per_s_live",
    "controller_events_per_s_backlog",
    "controller_rss_mb_10k",
    "k8s_formation_256_s",
    "k8s_writes_per_node",
    "formation_1008_s",
)
