"""Reading crisim's record: what the container runtime of a simulated node was asked to run.

One JSON object per line, with `op` RunPodSandbox, CreateContainer (`container`: its name, image,
command, env, mounts and `cdi_devices`) or ContainerExited (`exit_code`); `pod` names the pod
(name, namespace, uid) in each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def records(path: Path, op: str = "") -> Iterator[dict[str, Any]]:
    """The records of one node's runtime, oldest first (only those of `op` when given). A line
    still being written (no newline yet) is not returned."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        record = json.loads(line)
        if not op or record.get("op") == op:
            yield record


def created_containers(path: Path, pod_uid: str) -> list[dict[str, Any]]:
    """The CreateContainer records of the pod with `pod_uid`."""
    return [r for r in records(path, "CreateContainer") if r["pod"]["uid"] == pod_uid]
