"""Prometheus metrics of the advisor, on a registry the caller owns (one per service instance)."""

from __future__ import annotations

import prometheus_client as prom


class AdvisorMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.decisions = prom.Counter(
            "cd_advisor_decisions_total",
            "Placement decisions by policy and outcome (feasible or the infeasibility reason).",
            ["policy", "outcome"],
            registry=self.registry,
        )
        self.decision_seconds = prom.Histogram(
            "cd_advisor_decision_seconds",
            "Time to compute one placement decision (without the reservation write).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25),
            registry=self.registry,
        )
        self.reservations = prom.Counter(
            "cd_advisor_reservations_total",
            "Reservation writes by outcome (created, conflict, exists, released).",
            ["outcome"],
            registry=self.registry,
        )
        self.extender_releases = prom.Counter(
            "cd_advisor_extender_reservations_released_total",
            "Extender reservations released before their TTL, by reason (served: every node bound to "
            "the domain; domain-deleted; domain-absent: no record of the domain in the store).",
            ["reason"],
            registry=self.registry,
        )
        self.invalid_requests = prom.Counter(
            "cd_advisor_invalid_requests_total",
            "Requests refused as invalid, by field.",
            ["field"],
            registry=self.registry,
        )
        self.extender_requests = prom.Counter(
            "cd_advisor_extender_requests_total",
            "kube-scheduler extender calls by verb and result (ours, passthrough, bad_request, error).",
            ["verb", "result"],
            registry=self.registry,
        )
        self.free_nodes = prom.Gauge(
            "cd_advisor_free_nodes", "Free healthy nodes in the inventory.", registry=self.registry
        )
        self.inventory_nodes = prom.Gauge(
            "cd_advisor_inventory_nodes", "Node records in the inventory.", registry=self.registry
        )
        # Labelled children looked up once: `labels()` costs more than the count itself.
        self._decision_children: dict[tuple[str, str], prom.Counter] = {}
        self.fragmentation = prom.Gauge(
            "cd_advisor_fragmentation",
            "Fragmentation of the free capacity (0 = whole cliques).",
            registry=self.registry,
        )

    def count_decision(self, policy: str, outcome: str) -> None:
        child = self._decision_children.get((policy, outcome))
        if child is None:
            child = self._decision_children[(policy, outcome)] = self.decisions.labels(policy, outcome)
        child.inc()
