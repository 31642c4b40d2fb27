"""docker-compose.yml for real: `docker compose up` on a private docker engine, a job through it,
`docker compose down -v`.

The engine (tools/containers/engine.py) is Debian's dockerd in network and mount namespaces of its
own, so nothing of it reaches the host's network, mounts or iptables; the image is the one
`make image` built, moved in with `docker load`; compose is the plugin tools/containers/compose.sh
builds. Every service must turn healthy; `cdsim job` run by the file's jobs service (cdsim playing
kubelet) must form a Ready domain whose workload's IMEX imports are valid, with the invariants
holding; the dashboard must answer on its published port; after deleting the job nothing of it
may be left; `docker compose down -v` must leave no container, volume, network or mount; and the
engine must stop without anything forced.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools.containers.engine import Engine, EngineError, missing_tools
from tools.containers.images import SCHEDULER_IMAGE, load_built_image

REPO = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
IMAGE = "computedomains:dev"  # what every service of the file runs
SERVICES: dict[str, Any] = COMPOSE["services"]
UP_TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def compose_plugin_dir() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "tools/containers/compose.sh"), "--cached-only"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(proc.stderr.strip(), pytrace=False)
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    absent = missing_tools()
    if absent:
        pytest.fail(f"not installed: {', '.join(absent)}; run `make setup-containers`", pytrace=False)
    plugins = compose_plugin_dir()
    # Short: dockerd's and containerd's sockets live under it.
    eng = Engine(Path(tempfile.mkdtemp(prefix="cd-ce-")), plugin_dirs=[plugins])
    try:
        eng.start()
        began = time.monotonic()
        load_built_image(eng, IMAGE)
        print(f"image loaded in {time.monotonic() - began:.1f} s")
    except EngineError as exc:
        eng.stop()
        pytest.fail(str(exc), pytrace=False)
    yield eng
    problems = eng.stop()
    assert problems == [], problems
    assert not eng.root.exists()


def compose(engine: Engine, *args: str, timeout_s: float = 180.0, check: bool = True) -> str:
    proc = engine.run("compose", *args, cwd=REPO, timeout_s=timeout_s, check=False)
    output = (proc.stdout + proc.stderr).strip()
    if check and proc.returncode != 0:
        raise AssertionError(f"docker compose {' '.join(args)} exited {proc.returncode}:\n{output}")
    return output


def service_states(engine: Engine) -> dict[str, str]:
    """service -> "<state>/<health>" of the project's containers."""
    out = compose(engine, "ps", "--all", "--format", "json")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["Service"]: f"{r['State']}/{r.get('Health', '')}" for r in rows}


def wanted_state(service: str) -> str:
    # The jobs service only idles: no server to probe.
    return "running/healthy" if "healthcheck" in SERVICES[service] else "running/"


def wait_healthy(engine: Engine, deadline: float) -> dict[str, str]:
    """Every service running, and healthy where it has a health check; fails at `deadline`."""
    while True:
        states = service_states(engine)
        if sorted(states) == sorted(SERVICES) and all(wanted_state(s) == v for s, v in states.items()):
            return states
        exited = {s: v for s, v in states.items() if not v.startswith("running/")}
        assert not exited, f"containers not running: {exited}"
        assert time.monotonic() < deadline, f"not all healthy after {UP_TIMEOUT_S} s: {states}"
        time.sleep(2.0)


def engine_mounts(engine: Engine) -> set[str]:
    """Mount points in the engine's mount namespace (a container's layers, volumes, netns files)."""
    assert engine.process is not None
    text = Path(f"/proc/{engine.process.pid}/mountinfo").read_text()
    return {line.split()[4] for line in text.splitlines()}


def leftovers(engine: Engine) -> dict[str, list[str]]:
    def listing(*args: str) -> list[str]:
        return sorted(engine.run(*args).stdout.split())

    return {
        "containers": listing("ps", "--all", "--quiet"),
        "volumes": listing("volume", "ls", "--quiet"),
        "networks": listing("network", "ls", "--format", "{{.Name}}"),
    }


def documented_commands() -> list[list[str]]:
    """The `docker compose ...` lines of the file's opening comment, as the arguments after
    `docker compose` (an explanation after two spaces is not part of a command)."""
    commands = []
    for line in (REPO / "docker-compose.yml").read_text().splitlines():
        if not line.startswith("#"):
            break
        text = re.split(r"\s{2,}", line.lstrip("#").strip())[0]
        if text.startswith("docker compose "):
            commands.append(shlex.split(text)[2:])
    return commands


def documented(*words: str) -> list[str]:
    """The one documented command that has `words` in this order at its start."""
    [command] = [c for c in documented_commands() if c[: len(words)] == list(words)]
    return command


def jobs(engine: Engine, *args: str, timeout_s: float = 180.0) -> str:
    return compose(engine, "exec", "-T", "jobs", *args, timeout_s=timeout_s)


def test_compose_up_runs_a_job_and_down_leaves_nothing(engine: Engine) -> None:
    before = leftovers(engine)
    mounts_before = engine_mounts(engine)
    began = time.monotonic()
    try:
        compose(engine, "up", "--detach", timeout_s=UP_TIMEOUT_S)
        # Polled rather than `up --wait`, which gives up at the first "unhealthy": on a loaded
        # machine a program may start after its probes' start period, and turns healthy later.
        states = wait_healthy(engine, began + UP_TIMEOUT_S)
        up_s = time.monotonic() - began
        print(f"all {len(states)} services healthy after {up_s:.1f} s")

        # The job, by the commands the file documents.
        submit = documented("exec", "jobs", "cdsim", "job", "submit")
        job = submit[submit.index("submit") + 1]
        submitted = compose(engine, *submit, check=False)
        if "etcd did not answer" in submitted and "Try again." in submitted:
            # As cdsim says: on a starved machine a first connection can time out. Nothing was made.
            print(f"retrying once: {submitted.splitlines()[-1]}")
            submitted = compose(engine, *submit)
        assert f"Job default/{job}" in submitted and "imports" in submitted, submitted
        checked = compose(engine, *documented("exec", "jobs", "cdsim", "job", "check"))
        assert f"job default/{job}: all " in checked and "imports valid" in checked, checked
        invariants = jobs(engine, "cdsim", "check")
        assert "OK: invariants 1-4 hold" in invariants, invariants
        # Every node in the inventory (`cdsim check` cannot know which IMEX agents run here).
        get_nodes = documented("exec", "controller-0", "cdctl", "get", "nodes")
        nodes = json.loads(compose(engine, *get_nodes, "-o", "json"))
        assert len(nodes["items"]) == len([s for s in SERVICES if s.startswith("imex-")]), nodes
        get_domains = [
            *get_nodes[: get_nodes.index("nodes")],
            "domains",
            *get_nodes[get_nodes.index("nodes") + 1 :],
        ]
        domains = json.loads(compose(engine, *get_domains, "-o", "json"))
        [domain] = [d for d in domains["items"] if d["name"] == job]
        assert domain["status"]["status"] == "READY", domain

        # The dashboard answers on its published port, which is on the engine's own loopback.
        port = COMPOSE["services"]["dashboard"]["ports"][0].split(":")[1]
        probe = (
            "import json, urllib.request\n"
            f"page = urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5).read().decode()\n"
            f"state = json.load(urllib.request.urlopen('http://127.0.0.1:{port}/api/state', timeout=5))\n"
            "print(json.dumps({'page': page, 'state': state}))\n"
        )
        answered = engine.in_netns([sys.executable, "-c", probe])
        assert answered.returncode == 0, answered.stderr
        dashboard = json.loads(answered.stdout)
        assert "<html" in dashboard["page"].lower()
        assert dashboard["state"]["title"] == "docker compose: 1 rack x 4 trays"
        assert job in json.dumps(dashboard["state"]), "the dashboard does not show the job's domain"

        rss = engine.containers_memory_bytes()
        print(f"RSS of the compose cluster's containers: {rss / 2**20:.0f} MiB;"
              f" engine (dockerd, containerd, shims): {engine.daemon_rss_bytes() / 2**20:.0f} MiB")  # fmt: skip

        deleted = compose(engine, *documented("exec", "jobs", "cdsim", "job", "delete"))
        assert job in deleted, deleted
        idle = jobs(engine, "cdsim", "check", "--idle")
        assert "nothing of any domain is left" in idle, idle
    finally:
        if sys.exc_info()[0] is not None:
            print(compose(engine, "ps", "--all", check=False))
            print(compose(engine, "logs", "--no-color", "--tail", "40", check=False))
        downed = compose(engine, *documented("down"), check=False)
    print(f"compose test up to down: {time.monotonic() - began:.1f} s")
    assert leftovers(engine) == before, downed
    left = engine_mounts(engine) - mounts_before
    assert not left, f"mounts left after docker compose down -v: {sorted(left)}"


def test_the_scheduler_image_runs_cd_scheduler_as_the_manifests_user(engine: Engine) -> None:
    """`make image-scheduler`'s image (the chart's schedulerPlugin.image) runs the cd-scheduler
    the end-to-end tests run, as the user the chart's and the component's pod runs as."""
    load_built_image(engine, "computedomains-scheduler:dev", SCHEDULER_IMAGE)
    release = re.search(
        r"^\s*k8s\.io/kubernetes (v[0-9.]+)",
        (REPO / "integrations/scheduler-plugin/go.mod").read_text(),
        re.M,
    )
    assert release is not None
    version = engine.run(
        "run", "--rm", "--network", "none", "computedomains-scheduler:dev", "--version"
    ).stdout
    assert version.strip() == f"Kubernetes {release.group(1)}"
    [config] = json.loads(engine.run("image", "inspect", "computedomains-scheduler:dev").stdout)
    assert config["Config"]["User"] == "65532:65532"
    manifest = yaml.safe_load_all(
        (REPO / "manifests/components/scheduler-plugin/cd-scheduler.yaml").read_text()
    )
    [deployment] = [o for o in manifest if o and o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["containers"][0]["command"] == ["cd-scheduler"]
