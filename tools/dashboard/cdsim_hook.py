"""How `cdsim` runs the dashboard: one more supervised process, and where users find it.

The supervisor adds `dashboard_spec(...)` to the processes it runs (so the dashboard restarts like
any service and stops with `cdsim down`); its URL is the process's health URL in run.json, shown
by `cdsim up` and `cdsim status`. `CDSIM_DASHBOARD_PORT` pins the port (default: any free one).
"""

from __future__ import annotations

import os

from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState, SimConfig
from tools.cdsim.services import ServiceSpec
from tools.net_ports import free_port

DASHBOARD_NAME = "dashboard"
DASHBOARD_KIND = "dashboard"
DASHBOARD_TARGET = "tools.dashboard.main:main"
PORT_ENV = "CDSIM_DASHBOARD_PORT"
HOST = "127.0.0.1"


class DashboardPortError(ValueError):
    pass


def dashboard_port(environ: dict[str, str] | None = None) -> int:
    raw = (os.environ if environ is None else environ).get(PORT_ENV, "").strip()
    if not raw or raw == "0":
        return free_port(HOST)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise DashboardPortError(f"{PORT_ENV}={raw!r} is not a port number")
    return int(raw)


def dashboard_spec(layout: StateLayout, config: SimConfig, etcd_endpoint: str, port: int) -> ServiceSpec:
    argv = [
        "--etcd-endpoint", etcd_endpoint,
        "--sim-cluster", str(layout.cluster_file),
        "--host", HOST,
        "--port", str(port),
        "--title", f"cdsim: {config.racks} rack(s) x {config.trays_per_rack} trays",
        "--log-format", "json",
        "--log-level", config.log_level,
    ]  # fmt: skip
    return ServiceSpec(
        name=DASHBOARD_NAME,
        kind=DASHBOARD_KIND,
        target=DASHBOARD_TARGET,
        argv=argv,
        health_url=f"http://{HOST}:{port}/healthz",
        restart_delay_s=1.0,
    )


def dashboard_url(state: RunState | None) -> str:
    """The page's URL for a running cluster, or "" when it has no dashboard."""
    info = state.processes.get(DASHBOARD_NAME) if state is not None else None
    if info is None or not info.health_url.endswith("/healthz"):
        return ""
    return info.health_url.removesuffix("healthz")
