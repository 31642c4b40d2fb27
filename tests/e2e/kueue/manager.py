"""Kueue's manager (integrations/kueue/build.sh) running against an end-to-end environment's API server.

Everything it needs lives under one state directory:

- its CRDs (the module's config/components/crd/bases, as they are: no conversion webhook, so only
  the storage version v1beta2 is used);
- a CA of its own and a serving certificate for the loopback address its webhook server listens on
  (tools/controlplane/pki.py); Kueue's internal certificate management is off;
- the webhook configurations of the module's config/components/webhook/manifests.yaml for the
  enabled integration (batch/job) and Kueue's own objects, each pointing by `url:` at that address
  with the CA as caBundle (the shipped ones name a Service, which a loopback cluster cannot reach).

With internal certificate management off, Kueue's manager reads its metrics certificate from the
fixed path /etc/kueue/metrics/certs (cmd/kueue/main.go), whether metrics are served or not. It runs
in a mount namespace of its own where an overlay on /etc, whose upper layer is in the state
directory, holds that certificate: the host's /etc is not touched. That needs root (CI runs as root).
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.harness import log_tail, terminate
from tests.polling import wait_until
from tools.cached_tool import cached_tool
from tools.controlplane.cluster import ControlPlane, die_with_parent
from tools.controlplane.pki import CertKeyPair, issue_from_ca, new_ca
from tools.net_ports import free_ports

BUILD_SCRIPT = "integrations/kueue/build.sh"
NAMESPACE = "kueue-system"
# The integration enabled (Configuration.integrations.frameworks) and the API groups whose
# webhooks are registered: Job's, and Kueue's own objects'.
FRAMEWORKS = ("batch/job",)
WEBHOOK_GROUPS = frozenset({"batch", "kueue.x-k8s.io"})
WEBHOOK_PREFIX = "e2e-kueue"  # of the registered configurations' names
METRICS_CERT_DIR = Path("kueue/metrics/certs")  # under /etc, fixed in Kueue's main.go
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"


def kueue_build() -> Path:
    """The cache folder with the manager (`kueue`), `crd/` and `webhook/` (built on first use)."""
    return cached_tool(BUILD_SCRIPT)


def loopback_webhooks(
    manifests: list[dict[str, Any]], url_base: str, ca_bundle: bytes, prefix: str
) -> list[dict[str, Any]]:
    """The shipped webhook configurations with only the webhooks of WEBHOOK_GROUPS, each calling
    `url_base` + its path and trusting `ca_bundle`; names get `prefix`. Pure."""
    result = []
    for config in manifests:
        if config.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        config = copy.deepcopy(config)
        config["metadata"] = {"name": f"{prefix}-{config['metadata']['name']}"}
        kept = []
        for hook in config.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if not groups or not groups <= WEBHOOK_GROUPS:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"{url_base}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            kept.append(hook)
        if kept:
            config["webhooks"] = kept
            result.append(config)
    return result


@dataclass
class KueueManager:
    """One Kueue manager process for a control plane; its state under `root`."""

    cp: ControlPlane
    root: Path
    log_path: Path
    address: str = "127.0.0.1"
    feature_gates: dict[str, bool] = field(
        # TopologyAwareScheduling is beta and on by default in v0.17; named so that a later default
        # cannot turn it off under the test. The visibility server (another listener, on all
        # addresses, with its own certificate) is not needed here.
        default_factory=lambda: {"TopologyAwareScheduling": True, "VisibilityOnDemand": False}
    )
    process: subprocess.Popen[bytes] | None = None
    webhook_port: int = 0
    health_port: int = 0
    webhook_names: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)

    def configuration(self, cert_dir: Path) -> dict[str, Any]:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"{self.address}:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": self.address, "port": self.webhook_port, "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": list(FRAMEWORKS)},
            "featureGates": dict(self.feature_gates),
        }

    def start(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "running Kueue here needs root: its manager reads a fixed /etc/kueue/metrics/certs, "
                "which this harness provides in a private mount namespace (unshare, overlay mount)"
            )
        build = kueue_build()
        self.root.mkdir(parents=True, exist_ok=True)
        self.apply_crds(build / "crd")
        self.cp.kubectl("create", "namespace", NAMESPACE, check=False)
        self.webhook_port, self.health_port = free_ports(2, self.address)
        pki = self.root / "pki"
        pki.mkdir(exist_ok=True)
        ca = new_ca(pki, "ca", "kueue-webhook-ca")
        cert_dir = self.root / "webhook-certs"
        cert_dir.mkdir(exist_ok=True)
        serving = issue_from_ca(
            ca, cert_dir, "tls", "kueue-webhook", ip_addresses=(self.address,), server=True, client=False
        )
        etc_upper = self.root / "etc-upper"
        metrics = etc_upper / METRICS_CERT_DIR
        metrics.mkdir(parents=True, exist_ok=True)
        (metrics / "tls.crt").write_bytes(serving.cert_pem())
        (metrics / "tls.key").write_bytes(serving.key_pem())
        (metrics / "tls.key").chmod(0o600)
        etc_work = self.root / "etc-work"
        etc_work.mkdir(exist_ok=True)
        config_path = self.root / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.configuration(cert_dir)))
        tmp = self.root / "tmp"
        tmp.mkdir(exist_ok=True)
        mount = f"mount -t overlay overlay -o lowerdir=/etc,upperdir={etc_upper},workdir={etc_work} /etc"
        cmd = [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", f'{mount} && exec "$0" "$@"',
            str(build / "kueue"), f"--config={config_path}", "--zap-log-level=2",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.cp.kubeconfig), "TMPDIR": str(tmp)},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        try:
            wait_until(
                self._ready, "Kueue's manager to be ready", 120.0, explain=lambda: log_tail(self.log_path)
            )
            self.register_webhooks(build / "webhook" / "manifests.yaml", ca)
        except BaseException:
            self.stop()
            raise

    def apply(self, objects: list[dict[str, Any]]) -> None:
        """Server-side apply as admin; an error names what kubectl said."""
        out = self.cp.kubectl(
            "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects), check=False
        )
        if out.returncode != 0:
            kinds = sorted({o["kind"] for o in objects})
            raise RuntimeError(f"kubectl apply of {kinds} failed: {out.stderr.strip()}")

    def apply_crds(self, crd_dir: Path) -> None:
        crds = sorted(crd_dir.glob("*.yaml"))
        if not crds:
            raise RuntimeError(f"no CRD in {crd_dir}")
        self.cp.kubectl("apply", "--server-side", *[a for p in crds for a in ("-f", str(p))])
        names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in crds]
        self.cp.kubectl("wait", "--for=condition=Established", *[f"crd/{n}" for n in names], "--timeout=60s")

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"Kueue's manager exited with {self.process.returncode}:\n{log_tail(self.log_path, 40)}"
            )
        try:
            url = f"http://{self.address}:{self.health_port}/readyz"
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def register_webhooks(self, manifests_path: Path, ca: CertKeyPair) -> None:
        manifests = [d for d in yaml.safe_load_all(manifests_path.read_text()) if d]
        configs = loopback_webhooks(
            manifests, f"https://{self.address}:{self.webhook_port}", ca.cert_pem(), WEBHOOK_PREFIX
        )
        if not any(h["name"] == "mjob.kb.io" for c in configs for h in c["webhooks"]):
            raise RuntimeError(f"{manifests_path} has no Job webhook (mjob.kb.io)")
        self.apply(configs)
        self.webhook_names = [(c["kind"], c["metadata"]["name"]) for c in configs]
        wait_until(
            self._job_webhook_suspends,
            "the API server to call Kueue's Job webhook",
            30.0,
            explain=lambda: log_tail(self.log_path),
        )

    def _job_webhook_suspends(self) -> bool:
        """A dry-run Job for a queue comes back suspended: Kueue's mutating webhook ran."""
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "webhook-probe", "namespace": "default", "labels": {QUEUE_LABEL: "probe"}},
            "spec": {
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {"name": "c", "image": "probe", "resources": {"requests": {"cpu": "1m"}}}
                        ],
                    }
                }
            },
        }
        out = self.cp.kubectl(
            "create", "--dry-run=server", "-o", "jsonpath={.spec.suspend}", "-f", "-",
            input=yaml.safe_dump(job), check=False,
        )  # fmt: skip
        return out.returncode == 0 and out.stdout.strip() == "true"

    def stop(self) -> None:
        """Unregister the webhooks first (with the manager gone, their failurePolicy Fail would
        refuse every Job of the cluster), then stop the manager."""
        for kind, name in self.webhook_names:
            self.cp.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        self.webhook_names = []
        if self.process is not None:
            terminate(self.process.pid)
            self.process.wait(10)
            self.process = None
