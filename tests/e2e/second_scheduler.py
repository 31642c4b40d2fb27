"""cd-scheduler (integrations/scheduler-plugin) as a second scheduler beside an environment's own.

It runs with the shipped configuration of manifests/components/scheduler-plugin (its ConfigMap's
profile and the plugin's args), pointed at this environment's API server and at an advisor
address the test chooses, as kube-scheduler's user with the component's extra ClusterRole bound to
it. The binary comes from the cache (`make setup-k8s` builds it).
"""

from __future__ import annotations

import copy
import json
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.harness import REPO_ROOT, E2EEnvironment, log_tail, terminate
from tests.polling import wait_until
from tools.cachedtool import cached_tool
from tools.controlplane.cluster import die_with_parent
from tools.netports import free_port

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


def grant_plugin_reads(env: E2EEnvironment) -> None:
    """The component's extra ClusterRole, bound to kube-scheduler's user (the environment's
    scheduler identity) instead of the component's ServiceAccount."""
    role = next(o for o in component_objects() if o["kind"] == "ClusterRole")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "e2e-cd-scheduler-as-kube-scheduler"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUBE_SCHEDULER_USER}],
    }
    env.kubectl_apply([role, binding])


@dataclass
class SecondScheduler:
    """One cd-scheduler process; `profiles` maps schedulerName -> the advisor address its plugin uses."""

    env: E2EEnvironment
    profiles: dict[str, str]
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def log_path(self) -> Path:
        return self.env.layout.log_file("cd-scheduler")

    @property
    def work_dir(self) -> Path:
        return self.env.root / "cd-scheduler"

    def config(self) -> dict[str, Any]:
        """The shipped configuration, one profile per entry of `profiles`, on this control plane."""
        shipped = shipped_config()
        template = shipped["profiles"][0]
        profiles = []
        for name, address in self.profiles.items():
            profile = copy.deepcopy(template)
            profile["schedulerName"] = name
            args = next(c for c in profile["pluginConfig"] if c["name"] == PLUGIN)["args"]
            args["advisorAddress"] = address
            # Long: a reservation gone within a test was released, not expired.
            args["reservationTTLSeconds"] = 600
            args["callTimeout"] = "2s"
            profiles.append(profile)
        shipped["profiles"] = profiles
        shipped["clientConnection"] = {"kubeconfig": str(self.env.cp.scheduler_kubeconfig)}
        shipped["leaderElection"] = {"leaderElect": False}
        return shipped

    def start(self) -> None:
        binary = cd_scheduler_binary()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config()))
        self.port = free_port()
        kubeconfig = self.env.cp.scheduler_kubeconfig
        cmd = [
            str(binary),
            f"--config={config_path}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.work_dir / 'certs'}",
            "--logging-format=json",
            "-v=2",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        wait_until(
            self._healthy, "cd-scheduler to serve /healthz", 60.0, explain=lambda: log_tail(self.log_path)
        )

    def _healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"cd-scheduler exited with {self.process.returncode}:\n{log_tail(self.log_path)}"
            )
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # its serving certificate is self-signed
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{self.port}/healthz", timeout=2.0, context=ctx
            ) as r:
                return bool(r.read() == b"ok")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process.pid)
            self.process.wait(10)
            self.process = None

    def log_records(self, message: str) -> Iterator[dict[str, Any]]:
        """Its JSON log lines whose msg is `message`."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("msg") == message:
                yield record
