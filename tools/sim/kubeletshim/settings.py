"""Settings of the kubelet shim (flags ``--name``, environment ``KUBELET_SHIM_NAME``)."""

from __future__ import annotations

from dataclasses import dataclass

from libs.contract.names import DRIVER_NAME
from libs.runtime.settings import positive, setting


@dataclass(frozen=True)
class ShimSettings:
    kubeconfig: str = setting("", "kubeconfig file (empty = in-cluster config)")
    nodes_file: str = setting("", "JSON file listing the nodes to play (see tools.sim.kubeletshim.nodes)")
    sim_cluster: str = setting(
        "", "instead of --nodes-file: play every node of this simulated cluster description"
    )
    sim_nodes_dir: str = setting(
        "", "with --sim-cluster: base of the per-node directories (kubelet dir <base>/<node>/kubelet)"
    )
    driver: str = setting(DRIVER_NAME, "DRA driver whose claims the shim prepares")
    lease_duration_s: int = setting(40, "node Lease duration, seconds", validate=positive)
    lease_renew_interval_s: float = setting(10.0, "how often the node Lease is renewed", validate=positive)
    status_report_interval_s: float = setting(
        60.0, "how often the Node's Ready condition is re-posted", validate=positive
    )
    call_timeout_s: float = setting(
        60.0,
        "deadline of one NodePrepare/UnprepareResources call (kubelet: about the plugin's budget)",
        validate=positive,
    )
    api_timeout_s: float = setting(15.0, "deadline of each API server request", validate=positive)
    retry_initial_s: float = setting(0.5, "first delay before retrying a failed pod sync", validate=positive)
    retry_cap_s: float = setting(
        10.0, "longest delay between retries of a failed pod sync", validate=positive
    )
    watch_timeout_s: int = setting(
        300, "server-side end of each pod watch request, seconds", validate=positive
    )
    log_format: str = setting("auto", "log format", choices=("json", "console", "auto"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
