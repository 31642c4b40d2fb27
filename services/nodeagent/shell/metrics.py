"""Prometheus metrics of the node agent, on a registry of its own (one per agent instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Prepare on a READY node is a few milliseconds; waiting for a new IMEX domain takes seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prepares = Counter(
            "cd_nodeagent_prepare_total",
            "Claims prepared, by outcome (ok, permanent, retryable).",
            ["outcome"],
            registry=r,
        )
        self.unprepares = Counter(
            "cd_nodeagent_unprepare_total",
            "Claims unprepared, by outcome (ok, permanent, retryable).",
            ["outcome"],
            registry=r,
        )
        self.prepare_seconds = Histogram(
            "cd_nodeagent_prepare_seconds",
            "Time to prepare one claim.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unprepare_seconds = Histogram(
            "cd_nodeagent_unprepare_seconds",
            "Time to unprepare one claim.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prepared_claims = Gauge(
            "cd_nodeagent_prepared_claims",
            "Claims held by this node (prepare started or completed).",
            registry=r,
        )
        self.daemon_restarts = Gauge(
            "cd_nodeagent_imex_daemon_restarts",
            "Restarts of this node's IMEX daemon, per domain.",
            ["cd_uid"],
            registry=r,
        )
        self.reconciled = Counter(
            "cd_nodeagent_reconcile_actions_total",
            "Repairs made by the start-up reconcile, by action.",
            ["action"],
            registry=r,
        )
