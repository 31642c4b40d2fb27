"""cd-scheduler (integrations/scheduler-plugin) as a second scheduler beside an environment's own.

It runs with the shipped configuration of manifests/components/scheduler-plugin (its ConfigMap's
profile and the plugin's args), pointed at this environment's API server and at an advisor
address the test chooses, as kube-scheduler's user with the component's extra ClusterRole bound to
it. The binary comes from the cache (`make setup-k8s` builds it).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.harness import E2EEnvironment, log_tail, terminate
from tests.polling import wait_until
from tools import cd_scheduler
from tools.controlplane.cluster import die_with_parent
from tools.net_ports import free_port


def grant_plugin_reads(env: E2EEnvironment) -> None:
    """The component's extra ClusterRole, bound to kube-scheduler's user (the environment's
    scheduler identity) instead of the component's ServiceAccount."""
    env.kubectl_apply(cd_scheduler.plugin_reads("e2e-cd-scheduler-as-kube-scheduler"))


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
        # A long TTL: a reservation gone within a test was released, not expired.
        return cd_scheduler.config(
            self.profiles,
            self.env.cp.scheduler_kubeconfig,
            plugin_args={"reservationTTLSeconds": 600, "callTimeout": "2s"},
        )

    def start(self) -> None:
        binary = cd_scheduler.cd_scheduler_binary()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config()))
        self.port = free_port()
        kubeconfig = self.env.cp.scheduler_kubeconfig
        cmd = cd_scheduler.command(
            binary, config_path, kubeconfig, self.port, self.work_dir / "certs", self.extra_args
        )
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
        return cd_scheduler.healthy(self.port)

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
