"""Prometheus metrics of the dashboard, on a registry of its own (one per dashboard instance)."""

from __future__ import annotations

import prometheus_client as prom


class DashboardMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        self.clients = prom.Gauge(
            "cd_dashboard_clients", "Browsers connected to the live event stream.", registry=self.registry
        )
        self.store_events = prom.Counter(
            "cd_dashboard_store_events_total",
            "Store watch events and listings applied to the dashboard's view, by resource.",
            ["resource"],
            registry=self.registry,
        )
        self.updates_sent = prom.Counter(
            "cd_dashboard_updates_sent_total",
            "State documents sent to browsers over server-sent events.",
            registry=self.registry,
        )
