"""Prometheus metrics of the controller, on a registry of its own (one per controller instance)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import prometheus_client as prom

DOMAIN_STATES = ("Ready", "NotReady", "Terminating")


class ControllerMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.domains = prom.Gauge(
            "cd_controller_domains", "ComputeDomains in the store by status", ["status"], registry=r
        )
        self.reconcile_seconds = prom.Histogram(
            "cd_controller_reconcile_duration_seconds",
            "Time to reconcile one domain",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.reconcile_errors = prom.Counter(
            "cd_controller_reconcile_errors_total", "Reconciles that failed and were requeued", registry=r
        )
        self.reconciles = prom.Counter(
            "cd_controller_reconciles_total", "Reconciles run (successful or not)", registry=r
        )
        self.leader = prom.Gauge("cd_controller_leader", "1 while this replica is the leader", registry=r)
        self.store_events = prom.Counter(
            "cd_controller_store_events_total",
            "Store watch events applied to the controller's view",
            ["resource"],
            registry=r,
        )
        self.actions = prom.Counter(
            "cd_controller_actions_total",
            "Store actions applied by the controller",
            ["action", "result"],
            registry=r,
        )
        self.undecodable_values = prom.Counter(
            "cd_controller_undecodable_values_total",
            "Store values this build could not read, as the watch delivered them (the view drops the key)",
            ["resource"],
            registry=r,
        )
        self.status_writes = prom.Counter(
            "cd_controller_status_writes_total", "Domain status changes written to the store", registry=r
        )
        self.status_conflicts = prom.Counter(
            "cd_controller_status_conflicts_total",
            "Status writes that lost to a concurrent change of the domain record and were retried",
            registry=r,
        )
        self.view_revision = prom.Gauge(
            "cd_controller_view_revision",
            "Newest store revision applied to the controller's view (compare with etcd's to see watch lag)",
            registry=r,
        )
        self.queue_depth = prom.Gauge(
            "cd_controller_workqueue_depth", "Domain uids waiting for or in a reconcile", registry=r
        )
        self.leader_takeovers = prom.Counter(
            "cd_controller_leader_terms_total", "Times this replica became leader", registry=r
        )

    def track_domains(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Compute the domains-by-status gauge at scrape time from `counts()`."""
        for state in DOMAIN_STATES:

            def read(state: str = state) -> float:
                return float(counts().get(state, 0))

            self.domains.labels(status=state).set_function(read)

    def track_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(lambda: float(depth()))

    def events_total(self) -> float:
        total = 0.0
        for metric in self.store_events.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    total += sample.value
        return total
