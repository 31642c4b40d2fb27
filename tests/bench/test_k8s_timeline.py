"""Per-node timelines of a Kubernetes formation, put together from a kept run's logs."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tools.bench.k8s_timeline import collect, main, report

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC).timestamp()


def at(seconds: float) -> str:
    """The logs' timestamp of `seconds` after T0."""
    return datetime.fromtimestamp(T0 + seconds, tz=UTC).isoformat().replace("+00:00", "Z")


def write(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json: a library's line\n")


def kept_run(base: Path) -> Path:
    write(
        base / "audit.log",
        [
            {"verb": "create", "requestURI": "/apis/batch/v1/namespaces/b/jobs", "objectRef": {"resource": "jobs"},
             "requestReceivedTimestamp": at(1.0), "stageTimestamp": at(1.01)},
            {"verb": "create", "requestURI": "/api/v1/namespaces/b/pods/job-0-x/binding",
             "objectRef": {"resource": "pods", "name": "job-0-x", "subresource": "binding"},
             "requestReceivedTimestamp": at(2.0), "stageTimestamp": at(2.0)},
        ],
    )  # fmt: skip
    write(
        base / "kubeletshim.log",
        [
            {"event": "claims prepared", "node": "n1", "pod": "b/job-0-x", "timestamp": at(9.0)},
            {"event": "pod running", "node": "n1", "timestamp": at(9.5)},
        ],
    )
    write(
        base / "host-0.log",
        [
            {"event": "prepare: node joined domain", "node": "n1", "timestamp": at(3.0)},
            {"event": "binding seen", "node": "n1", "cd_uid": "d", "timestamp": at(3.5)},
            {"event": "IMEX daemon started", "node": "n1", "timestamp": at(4.0)},
            {"event": "IMEX daemon state", "node": "n1", "state": "STARTING", "timestamp": at(4.1)},
            {"event": "IMEX daemon state", "node": "n1", "state": "READY", "timestamp": at(5.0)},
            {"event": "daemon status written", "node": "n1", "state": "READY", "timestamp": at(6.0)},
            {"event": "daemon status seen", "node": "n1", "state": "READY", "timestamp": at(8.0)},
            {"event": "claim prepared", "node": "n1", "timestamp": at(8.5)},
            # Teardown: the binding gone, seen again; not a step.
            {"event": "binding seen", "node": "n1", "cd_uid": None, "timestamp": at(20.0)},
            # A node whose pod never ran is left out.
            {"event": "prepare: node joined domain", "node": "n2", "timestamp": at(3.0)},
        ],
    )
    return base


def test_each_node_s_steps_come_from_the_audit_log_the_shim_and_its_host(tmp_path: Path) -> None:
    job_created, nodes = collect(kept_run(tmp_path))
    assert job_created == pytest.approx(T0 + 1.0)
    assert list(nodes) == ["n1"]
    since = {step: round(t - job_created, 3) for step, t in nodes["n1"].at.items()}
    assert since == {
        "bound": 1.0, "joined": 2.0, "binding_seen": 2.5, "started": 3.0, "ready": 4.0,
        "written": 5.0, "seen": 7.0, "prepared": 7.5, "running": 8.5,
    }  # fmt: skip
    text = report(job_created, nodes)
    assert "written -> seen         n=   1 p10   2.00  p50   2.00  p90   2.00  max   2.00 s" in text
    assert "n1: bound=1.00 joined=2.00" in text


def test_a_directory_without_an_audit_log_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert f"{tmp_path} has no audit.log" in capsys.readouterr().err
