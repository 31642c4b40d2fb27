"""`make image-smoke`: the built image runs a 2-node simulated job.

From the image, each in its own container (the run's state directory bind-mounted at the same
path): etcd on loopback, the placement advisor, a domain controller, and per simulated node (one
rack, two trays) its IMEX agent and its kubelet plugin, with the flags `cdsim up` gives them
(tools/cdsim/services.py). Two runtimes:

- docker (`docker run`): a private dockerd (tools/containers/engine.py) with the image moved in by
  `docker load`; the containers have the engine's host network, which is a network namespace of
  the engine's own, so this program runs its job flow in that namespace (it starts itself again
  there, --inside-engine);
- buildah (`buildah run --isolation chroot`): no engine, the host's network.

Then, from the host, the `cdsim job` flow against them: placement, a ComputeDomain and one channel
claim per node, NodePrepareResources on each plugin's DRA socket, the domain Ready, the
workload's IMEX imports checked intact; then teardown (unprepare, the domain removed by the
controller). Every container is stopped and removed at the end, and the run fails if a process
had to be killed or the IMEX daemons outlived the teardown (under docker: if anything but the
program still ran in a container when it was stopped, or the engine left anything behind).

    python -m tools.image.smoke [--runtime docker|buildah] [--image localhost/computedomains:dev] [--keep-state]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import structlog

from libs.runtime.logging import configure_logging
from tools.bench.simenv import free_address_block
from tools.cdsim import jobs
from tools.cdsim.job_book import JobBook
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.run_state import RunState, SimConfig
from tools.cdsim.services import (
    ADVISOR_TARGET,
    AGENT_TARGET,
    CONTROLLER_TARGET,
    IMEX_AGENT_TARGET,
    ServiceSpec,
    advisor_spec,
    agent_spec,
    controller_spec,
    imex_agent_spec,
)
from tools.containers.docker_run import DockerContainer
from tools.containers.engine import Engine, EngineError
from tools.containers.images import load_built_image
from tools.image.container import Container, ContainerError, buildah
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs

log = structlog.get_logger(__name__)

DEFAULT_IMAGE = "localhost/computedomains:dev"
# The image's console scripts (pyproject.toml) for cdsim's service targets.
SCRIPTS = {
    ADVISOR_TARGET: "cd-placement-advisor",
    CONTROLLER_TARGET: "cd-controller",
    IMEX_AGENT_TARGET: "cd-imex-agent",
    AGENT_TARGET: "cd-node-agent",
}
HEALTH_TIMEOUT_S = 90.0
JOB = "image-smoke"
RUNTIMES = ("docker", "buildah")


class SmokeFailed(RuntimeError):
    pass


def etcd_argv(data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        "etcd", "--name=smoke", f"--data-dir={data_dir}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=smoke={peer}", "--log-level=warn",
    ]  # fmt: skip


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(
    container: Container | DockerContainer, url: str, timeout_s: float = HEALTH_TIMEOUT_S
) -> float:
    """Seconds until `url` answers 200; fails early, with the log's tail, if the program exits."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if healthy(url):
            return time.monotonic() - began
        if not container.running():
            tail = container.log_file.read_text(errors="replace").splitlines()[-15:]
            raise SmokeFailed(f"{container.name} exited before {url} was healthy:\n" + "\n".join(tail))
        time.sleep(0.2)
    raise SmokeFailed(
        f"{container.name}: {url} not healthy after {timeout_s:.0f} s (log {container.log_file})"
    )


class Smoke:
    def __init__(self, image: str, root: Path, runtime: str = "buildah") -> None:
        self.image = image
        self.layout = StateLayout.at(root)
        self.runtime = runtime
        self.tag = uuid.uuid4().hex[:8]
        self.containers: list[Container | DockerContainer] = []

    def container(self, name: str, argv: list[str], health_url: str, sys_admin: bool = False) -> None:
        args = (
            f"cd-smoke-{self.tag}-{name}",
            self.image,
            argv,
            [self.layout.root],
            self.layout.log_file(name),
        )
        # An IMEX agent gives each daemon a mount namespace of its own (as in docker-compose.yml).
        # An IMEX agent's fork server of simulated daemons ends with its agent; the daemons it forks
        # must be gone once their domain is (tools/sim/imex/fork_server.py).
        helpers = ("tools/sim/imex/fork_server.py",) if sys_admin else ()
        c = (
            DockerContainer(*args, sys_admin=sys_admin, helpers=helpers)
            if self.runtime == "docker"
            else Container(*args, cap_add=("CAP_SYS_ADMIN",) if sys_admin else ())
        )
        self.containers.append(c)
        c.start()
        took = wait_healthy(c, health_url)
        print(f"  {name:<22} {argv[0]:<22} healthy after {took:4.1f} s", flush=True)

    def service(self, spec: ServiceSpec) -> None:
        sys_admin = spec.target == IMEX_AGENT_TARGET
        self.container(spec.name, [SCRIPTS[spec.target], *spec.argv], spec.health_url, sys_admin)

    def start(self) -> RunState:
        layout = self.layout
        layout.logs_dir.mkdir(parents=True, exist_ok=True)
        cluster = ClusterDescription(racks=1, trays_per_rack=2, address_block=free_address_block(1, 2))
        cluster.save(layout.cluster_file)
        for node in cluster.node_names():
            prepare_node_dirs(cluster, node, layout.nodes_dir)
        config = SimConfig(racks=1, trays_per_rack=2, controllers=1)
        etcd_port, peer_port = free_port(), free_port()
        etcd = f"127.0.0.1:{etcd_port}"
        grpc_port, advisor_health, controller_health = free_port(), free_port(), free_port()
        how = (
            "docker run, the engine's network"
            if self.runtime == "docker"
            else "buildah run --isolation chroot, host network"
        )
        print(f"Starting from image {self.image} ({how}):", flush=True)
        self.container("etcd", etcd_argv(layout.etcd_dir, etcd_port, peer_port), f"http://{etcd}/health")
        self.service(advisor_spec(grpc_port, advisor_health, config, etcd))
        self.service(controller_spec(0, controller_health, config, etcd))
        for node in cluster.node_names():
            self.service(imex_agent_spec(cluster, node, layout, config, etcd))
            self.service(agent_spec(cluster, node, layout, config, etcd))
        # What `cdsim job` reads to find the services (the supervisor writes it under `cdsim up`).
        state = RunState(
            phase="ready", etcd_endpoint=etcd, advisor_endpoint=f"127.0.0.1:{grpc_port}",
            started_unix_ms=int(time.time() * 1000), ready_unix_ms=int(time.time() * 1000),
        )  # fmt: skip
        state.save(layout)
        return state

    async def job(self) -> None:
        out = sys.stdout
        job = await jobs.submit(
            self.layout, jobs.SubmitOptions(name=JOB, num_nodes=2, wait=True, ready_timeout_s=90.0), out
        )
        for claim in job.claims:
            specs = sorted(p.name for p in self.layout.node(claim.node).cdi_root.glob("*"))
            if not specs:
                raise SmokeFailed(f"{claim.node}: claim {claim.name} prepared but no CDI spec was written")
            print(f"  {claim.node}: CDI spec {', '.join(specs)}", flush=True)
        await jobs.check_job(self.layout, jobs.CheckOptions(name=JOB), out)
        await jobs.delete(self.layout, jobs.DeleteOptions(name=JOB, wait=True, timeout_s=60.0), out)
        if JobBook(self.layout.jobs_file).read().jobs:
            raise SmokeFailed("the job is still in the job book after its deletion")
        for claim in job.claims:
            left = list(self.layout.node(claim.node).cdi_root.glob("*"))
            if left:
                raise SmokeFailed(f"{claim.node}: CDI specs left after unprepare: {left}")

    def stop(self) -> list[str]:
        """Stop every container, last started first; what had to be killed, as problems."""
        problems = []
        for c in reversed(self.containers):
            try:
                killed = c.stop()
            except ContainerError as exc:
                problems.append(str(exc))
                continue
            if killed:
                problems.append(f"{c.name}: {len(killed)} processes still ran after SIGTERM and were killed")
            if isinstance(c, DockerContainer) and c.left_behind:
                problems.append(f"{c.name}: still running besides the program: {c.left_behind}")
        self.containers.clear()
        return problems


def image_exists(image: str) -> bool:
    try:
        buildah("inspect", "--type", "image", image)
    except ContainerError:
        return False
    return True


def missing_image(image: str) -> str:
    """Why `image` cannot be run ("" when it can): it comes from buildah's storage either way."""
    if shutil.which("buildah") is None:
        return "buildah is not installed; `make image` installs it and builds the image"
    if not image_exists(image):
        return f"no image {image} in buildah's storage; build it with `make image`"
    return ""


def run_in_engine(image: str, keep_state: bool) -> int:
    """Start a private docker engine, load the image into it, run the smoke (docker runtime) in
    the engine's network namespace, stop the engine; fails too if the engine left anything."""
    problem = missing_image(image)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Short: dockerd's and containerd's sockets live under it.
    engine = Engine(Path(tempfile.mkdtemp(prefix="cd-se-")))
    began = time.monotonic()
    code = 1
    try:
        engine.start()
        load_built_image(engine, image, image)
        print(
            f"Private docker engine up and the image loaded after {time.monotonic() - began:.1f} s.",
            flush=True,
        )
        inner = [sys.executable, "-m", "tools.image.smoke", "--runtime", "docker", "--inside-engine"]
        inner += ["--image", image, *(["--keep-state"] if keep_state else [])]
        code = subprocess.run(engine.netns_argv(inner), env=engine.env(), check=False).returncode
    except EngineError as exc:
        print(f"image smoke FAILED: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("image smoke FAILED: interrupted", file=sys.stderr)
    finally:
        problems = engine.stop()
    if problems:
        print("image smoke FAILED: the engine did not stop cleanly:\n" + "\n".join(problems), file=sys.stderr)
        return code or 1
    print("The engine stopped; nothing of it is left (processes, mounts, cgroups, files).")
    return code


def run(image: str, keep_state: bool, runtime: str = "buildah") -> int:
    if runtime == "buildah":
        problem = missing_image(image)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    # Short: unix socket paths under it must stay within 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="cd-smoke-"))
    smoke = Smoke(image, root, runtime)
    began = time.monotonic()
    failure = ""
    try:
        smoke.start()
        print(f"Services up after {time.monotonic() - began:.1f} s. The 2-node job:", flush=True)
        asyncio.run(smoke.job())
    except (SmokeFailed, CommandError, ContainerError, TimeoutError) as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        failure = "interrupted"
    finally:
        problems = smoke.stop()
    if problems:
        failure = "\n".join([failure, *problems]).strip()
    summary = {
        "image": image,
        "runtime": runtime,
        "ok": not failure,
        "seconds": round(time.monotonic() - began, 1),
    }
    if failure:
        print(f"image smoke FAILED: {failure}\n(logs in {smoke.layout.logs_dir})", file=sys.stderr)
        keep_state = True
    else:
        print("All containers stopped and removed; nothing left running.")
    print(json.dumps(summary))
    if not keep_state:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not failure else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the image to exercise (default: %(default)s)")
    parser.add_argument("--keep-state", action="store_true", help="keep the state directory and logs")
    parser.add_argument("--runtime", choices=RUNTIMES, default="docker", help="default: %(default)s")
    # Set by the docker runtime's own second start, in the engine's network namespace.
    parser.add_argument("--inside-engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configure_logging("console", "warning", stream=sys.stderr)
    if args.runtime == "docker" and not args.inside_engine:
        sys.exit(run_in_engine(args.image, args.keep_state))
    sys.exit(run(args.image, args.keep_state, args.runtime))


if __name__ == "__main__":
    main()
