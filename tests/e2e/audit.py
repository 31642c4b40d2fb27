"""The kube-apiserver's audit log as a test reads it: which writes a client made, and when.

A test passes `apiserver_args(root)` to the environment; the API server then logs (at Metadata
level, once each request completes) every create, update and patch of ComputeDomains (and their
status), Events and Nodes, in JSON lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted", "Panic"],
    "rules": [
        {
            "level": "Metadata",
            "verbs": ["create", "update", "patch"],
            "resources": [
                {"group": "resource.nvidia.com", "resources": ["computedomains", "computedomains/status"]},
                {"group": "", "resources": ["events", "nodes"]},
            ],
        },
        {"level": "None"},
    ],
}


def apiserver_args(root: Path) -> list[str]:
    """Flags that make the API server log those writes to `root`/audit.log (policy written there)."""
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(_POLICY))
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={root / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
    ]


@dataclass(frozen=True, slots=True)
class Write:
    verb: str
    resource: str  # e.g. "computedomains/status", "events", "nodes"
    namespace: str
    name: str
    user_agent: str
    code: int


def writes(root: Path, user_agent_prefix: str) -> list[Write]:
    """The completed writes logged so far whose client's user agent starts with the prefix."""
    path = root / "audit.log"
    out: list[Write] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written
        agent = str(event.get("userAgent", ""))
        if event.get("stage") != "ResponseComplete" or not agent.startswith(user_agent_prefix):
            continue
        ref = event.get("objectRef") or {}
        sub = ref.get("subresource")
        out.append(
            Write(
                verb=str(event.get("verb", "")),
                resource=f"{ref.get('resource', '')}/{sub}" if sub else str(ref.get("resource", "")),
                namespace=str(ref.get("namespace", "")),
                name=str(ref.get("name", "")),
                user_agent=agent,
                code=int((event.get("responseStatus") or {}).get("code", 0)),
            )
        )
    return out
