"""cd-scheduler (integrations/scheduler-plugin) run beside a local control plane's own scheduler.

It runs with the shipped configuration of manifests/components/scheduler-plugin (its ConfigMap's
profile and the plugin's args), one profile per scheduler name, each pointed at an advisor address
the caller chooses, as kube-scheduler's user with the component's extra ClusterRole bound to it.
The binary comes from the cache (`make setup-k8s` builds it). Used by the end-to-end tests
(tests/e2e/second_scheduler.py) and the gang placement benchmark (tools/bench/gang_placement.py).
"""

from __future__ import annotations

import copy
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tools.cached_tool import cached_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPONENT = REPO_ROOT / "manifests" / "components" / "scheduler-plugin" / "cd-scheduler.yaml"
PLUGIN = "ComputeDomainPlacement"
KUBE_SCHEDULER_USER = "system:kube-scheduler"


def component_objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(COMPONENT.read_text()) if d]


def shipped_config() -> dict[str, Any]:
    """The KubeSchedulerConfiguration of the component's ConfigMap."""
    config_map = next(o for o in component_objects() if o["kind"] == "ConfigMap")
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["config.yaml"])
    return config


def cd_scheduler_binary() -> Path:
    return cached_tool("integrations/scheduler-plugin/build.sh") / "cd-scheduler"


def plugin_reads(binding_name: str) -> list[dict[str, Any]]:
    """The component's extra ClusterRole and a binding of it to kube-scheduler's user (a local
    control plane's scheduler identity) instead of the component's ServiceAccount."""
    role = next(o for o in component_objects() if o["kind"] == "ClusterRole")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": binding_name},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUBE_SCHEDULER_USER}],
    }
    return [role, binding]


def config(
    profiles: dict[str, str],
    kubeconfig: Path,
    plugin_args: dict[str, Any] | None = None,
    scheduler_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The shipped configuration with one profile per entry of `profiles` (schedulerName ->
    advisor address), `plugin_args` over the shipped plugin args and `scheduler_settings` over the
    configuration's top level, on the control plane of `kubeconfig` (no leader election)."""
    shipped = shipped_config()
    template = shipped["profiles"][0]
    out = []
    for name, address in profiles.items():
        profile = copy.deepcopy(template)
        profile["schedulerName"] = name
        args = next(c for c in profile["pluginConfig"] if c["name"] == PLUGIN)["args"]
        args["advisorAddress"] = address
        args.update(plugin_args or {})
        out.append(profile)
    shipped["profiles"] = out
    shipped["clientConnection"] = {"kubeconfig": str(kubeconfig)}
    shipped["leaderElection"] = {"leaderElect": False}
    shipped.update(scheduler_settings or {})
    return shipped


def command(
    binary: Path,
    config_path: Path,
    kubeconfig: Path,
    port: int,
    cert_dir: Path,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """cd-scheduler's command line: serving /healthz on 127.0.0.1:`port`, JSON logs."""
    return [
        str(binary),
        f"--config={config_path}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        "--logging-format=json",
        "-v=2",
        *extra_args,
    ]


def healthy(port: int) -> bool:
    """Whether cd-scheduler on 127.0.0.1:`port` answers /healthz with ok."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # its serving certificate is self-signed
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2.0, context=ctx) as r:
            return bool(r.read() == b"ok")
    except OSError:
        return False
