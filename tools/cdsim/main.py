"""`cdsim`: run a simulated NVL72 cluster and jobs on it, from the command line.

    cdsim up [--racks N] [--trays 18, or 8 with --kubernetes] [--partitions-per-rack 1] [--state-dir DIR] [--kubernetes] [--plaintext]
             [--driver-version [NODE=]VERSION ...]
    cdsim job submit NAME --nodes N [-n NS] [--all-channels] [--wait]
    cdsim job wait NAME [-n NS] [--status Ready|NotReady] [--reason R] [--timeout S]
    cdsim job delete NAME [-n NS] [--wait]
    cdsim status [--json]
    cdsim job scale NAME --nodes N [-n NS] [--timeout S]
    cdsim job check NAME [-n NS]
    cdsim fault kill-agent NODE [--down-for S] | kill-imex-agent NODE [--down-for S]
                | kill-node NODE [--down-for S] | kill-imex NODE | kill-controller REPLICA
                | restart-etcd | partition-etcd NODE --down-for S | cut-links NODE --for S
    cdsim check [--idle] [--settle S]
    cdsim down

Every command takes `--state-dir` (default `$CDSIM_STATE_DIR` or `<tmp>/cdsim-<uid>`), before or
after the command name. Exit status: 0 success, 1 failure (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TextIO

import aetcd.exceptions

from libs.invariants import checker as invariants
from libs.kube.names import label_problem, subdomain_problem
from libs.runtime.logging import configure_logging
from libs.state.store import TRANSIENT_ERRORS
from tools.cdsim import faults, job_scaling, jobs, lifecycle
from tools.cdsim.advisor import PLACEMENT_MODES
from tools.cdsim.job_book import JobBook
from tools.cdsim.kube_plane import DEFAULT_TRAYS as KUBE_DEFAULT_TRAYS
from tools.cdsim.layout import StateLayout, cluster_node_paths
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.run_state import RunState
from tools.cdsim.services import IMEX_AGENT_KIND
from tools.cdsim.status import collect, render
from tools.dashboard.cdsim_hook import dashboard_url
from tools.sim.hardware.cluster import ClusterDescription


def _state_dir_option(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--state-dir",
        default=default,
        help="the cluster's state directory (default: $CDSIM_STATE_DIR or <tmp>/cdsim-<uid>)",
    )


def _namespace(value: str) -> str:
    """A namespace as the API server takes it: a DNS-1123 label."""
    problem = label_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"namespace {problem}")
    return value


def _job_name(value: str) -> str:
    """A job's name is its ComputeDomain's: a DNS-1123 subdomain, as for most kinds."""
    problem = subdomain_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"job (ComputeDomain) name {problem}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdsim",
        description="Run a simulated NVL72 cluster (etcd, domain controller, placement advisor, one node "
        "agent per tray) and ComputeDomain jobs on it.",
    )
    _state_dir_option(parser, None)
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings on stderr")
    # Sub-commands accept --state-dir too; SUPPRESS keeps a value given before the command.
    common = argparse.ArgumentParser(add_help=False)
    _state_dir_option(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", parents=[common], help="start a simulated cluster in the background")
    up.add_argument("--racks", type=int, default=1, help="NVL72 racks (default 1)")
    up.add_argument(
        "--trays",
        type=int,
        default=None,
        help=f"compute trays (nodes) per rack (default 18; with --kubernetes {KUBE_DEFAULT_TRAYS}, see "
        "docs/simulation.md: each node runs a real kubelet, and this machine's inotify instances bound them)",
    )
    up.add_argument("--partitions-per-rack", type=int, default=1, help="NVLink partitions (cliques) per rack")
    up.add_argument(
        "--address-block",
        type=int,
        default=1,
        help="second octet of node addresses 127.<block>.<rack>.<tray+1>",
    )
    up.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    up.add_argument(
        "--driver-version",
        action="append",
        default=[],
        metavar="[NODE=]VERSION",
        help="NVIDIA driver version the nodes report (NVML); NODE=VERSION for one node (repeatable). "
        "Host names in the IMEX nodes config need 570.158.01 or later",
    )
    up.add_argument(
        "--kubernetes",
        action="store_true",
        help="also run a real Kubernetes control plane, a real kubelet for every node (on a simulated "
        "container runtime) and the services in Kubernetes mode; prints `export KUBECONFIG=...` for "
        "kubectl apply of your own manifests",
    )
    up.add_argument(
        "--plaintext",
        action="store_true",
        help="etcd without TLS and auth and the placement advisor without mutual TLS (default: both "
        "secured as in production, certificates in <state dir>/pki, found there by every cdsim client)",
    )
    up.add_argument(
        "--mesh",
        default="tls",
        choices=("tls", "plaintext"),
        help="IMEX daemons of new domains talk mutual TLS with per-domain certificates (default) or plaintext",
    )
    up.add_argument(
        "--mesh-certificate-validity-s",
        type=float,
        default=24 * 3600.0,
        help="lifetime of a node's mesh certificate; renewed at two thirds (short values show rotation)",
    )

    sub.add_parser("down", parents=[common], help="stop everything `up` started")

    status = sub.add_parser("status", parents=[common], help="nodes, domains and jobs")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    check = sub.add_parser("check", parents=[common], help="check the invariants of docs/state-model.md now")
    check.add_argument(
        "--idle", action="store_true", help="also require that no domain leaves anything behind"
    )
    check.add_argument(
        "--settle",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long nodes may take to catch up (invariant 4, leftovers) before it counts as a violation",
    )

    job = sub.add_parser("job", help="submit, scale, check or delete a job (a ComputeDomain and its claims)")
    job_sub = job.add_subparsers(dest="job_command", required=True, metavar="ACTION")
    submit = job_sub.add_parser("submit", parents=[common], help="place, create and prepare a job")
    submit.add_argument("name", type=_job_name)
    submit.add_argument("--nodes", type=int, required=True, help="number of nodes (one claim each)")
    submit.add_argument("-n", "--namespace", default="default", type=_namespace)
    submit.add_argument("--all-channels", action="store_true", help="allocationMode All (all 2048 channels)")
    submit.add_argument("--wait", action="store_true", help="wait until the ComputeDomain is Ready")
    submit.add_argument("--placement", default="single-clique", choices=sorted(PLACEMENT_MODES))
    submit.add_argument(
        "--timeout", type=float, default=120.0, help="seconds kubelet keeps retrying prepares"
    )
    wait = job_sub.add_parser("wait", parents=[common], help="wait until a job's domain is Ready / NotReady")
    wait.add_argument("name", type=_job_name)
    wait.add_argument("-n", "--namespace", default="default", type=_namespace)
    wait.add_argument("--status", choices=("Ready", "NotReady"), default="Ready")
    wait.add_argument("--reason", default="", help="also require this Ready-condition reason (e.g. NodeLost)")
    wait.add_argument("--timeout", type=float, default=60.0)
    check_job = job_sub.add_parser(
        "check", parents=[common], help="exit 0 only if all of the job's IMEX imports are still valid"
    )
    check_job.add_argument("name", type=_job_name)
    check_job.add_argument("-n", "--namespace", default="default", type=_namespace)
    scale = job_sub.add_parser(
        "scale",
        parents=[common],
        help="grow a running job to N nodes in its clique (or shrink it: the last nodes added leave)",
    )
    scale.add_argument("name", type=_job_name)
    scale.add_argument("--nodes", type=int, required=True, help="the job's new number of nodes")
    scale.add_argument("-n", "--namespace", default="default", type=_namespace)
    scale.add_argument("--timeout", type=float, default=120.0, help="seconds kubelet keeps retrying")
    delete = job_sub.add_parser("delete", parents=[common], help="unprepare and delete a job")
    delete.add_argument("name", type=_job_name)
    delete.add_argument("-n", "--namespace", default="default", type=_namespace)
    delete.add_argument("--wait", action="store_true", help="wait until the domain is torn down")
    delete.add_argument("--timeout", type=float, default=60.0)

    fault = sub.add_parser("fault", help="inject a fault")
    fault_sub = fault.add_subparsers(dest="fault", required=True, metavar="FAULT")
    down_for = argparse.ArgumentParser(add_help=False)
    down_for.add_argument(
        "--down-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="keep it down this long before the supervisor restarts it (default: the usual restart delay)",
    )
    kill_agent = fault_sub.add_parser(
        "kill-agent", parents=[common, down_for], help="SIGKILL a node's kubelet plugin (cd-node-agent)"
    )
    kill_agent.add_argument("node")
    kill_imex_agent = fault_sub.add_parser(
        "kill-imex-agent",
        parents=[common, down_for],
        help="SIGKILL a node's IMEX agent (its daemons live on)",
    )
    kill_imex_agent.add_argument("node")
    kill_node = fault_sub.add_parser(
        "kill-node",
        parents=[common, down_for],
        help="kill everything of a node (plugin, IMEX agent, IMEX daemons): the node is lost",
    )
    kill_node.add_argument("node")
    kill_imex = fault_sub.add_parser("kill-imex", parents=[common], help="SIGKILL a node's IMEX daemon")
    kill_imex.add_argument("node")
    kill_controller = fault_sub.add_parser(
        "kill-controller", parents=[common, down_for], help="SIGKILL a controller replica (0 or 1)"
    )
    kill_controller.add_argument("replica", type=int)
    fault_sub.add_parser("restart-etcd", parents=[common], help="stop etcd and start it on the same data")
    partition = fault_sub.add_parser(
        "partition-etcd",
        parents=[common],
        help="cut one node's programs off etcd for a while (its IMEX daemons and peer links stay)",
    )
    partition.add_argument("node")
    partition.add_argument(
        "--down-for", type=float, required=True, metavar="SECONDS", help="how long the node stays cut off"
    )
    cut = fault_sub.add_parser(
        "cut-links",
        parents=[common],
        help="cut a node's IMEX links both ways for a while (every process lives)",
    )
    cut.add_argument("node")
    cut.add_argument(
        "--for", dest="seconds", type=float, required=True, metavar="SECONDS", help="how long the cut lasts"
    )
    return parser


async def _status(layout: StateLayout, as_json: bool, out: TextIO) -> None:
    state = jobs.running_state(layout)
    async with jobs.open_store(state) as store:
        job_list = await jobs.prune_finished(layout, store)
        doc = await collect(layout, state, store, job_list)
    # The live dashboard (tools/dashboard), when this cluster runs one.
    doc["dashboard_url"] = dashboard_url(state)
    text = render(doc) + (f"\n  dashboard {doc['dashboard_url']}" if doc["dashboard_url"] else "")
    # `up --kubernetes`: how to reach its API server again.
    doc["kubeconfig"] = state.kubeconfig
    if state.kubeconfig:
        text += f"\n  kubernetes: export KUBECONFIG={state.kubeconfig} PATH={state.kube_bin_dir}:$PATH"
    out.write((json.dumps(doc, indent=2) if as_json else text) + "\n")


async def _check(layout: StateLayout, idle: bool, settle_s: float, out: TextIO) -> None:
    state = jobs.running_state(layout)
    cluster = ClusterDescription.load(layout.cluster_file)
    paths = cluster_node_paths(layout, cluster.node_names())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    async with jobs.open_store(state) as store:
        while True:
            violations = await invariants.check_store_invariants(store, nodes=paths)
            # Read each round: an agent the supervisor restarts is alive again only once it runs.
            live = (RunState.load(layout) or state).live_nodes(IMEX_AGENT_KIND)
            violations += await invariants.check_inventory(store, live)
            if idle:
                violations += await invariants.check_cluster_idle(store, paths)
            # 1-3 must hold at every instant; 4, 7 (an agent registering) and "nothing left" only
            # once the nodes have caught up.
            converging = all(v.startswith(("inv4:", "inv7:", "idle:")) for v in violations)
            if not violations or not converging or loop.time() >= deadline:
                break
            await asyncio.sleep(0.25)
    if violations:
        raise CommandError("invariants violated:\n" + "\n".join(f"  {v}" for v in violations))
    what = "invariants 1-4 hold, every node whose IMEX agent runs is in the inventory" + (
        " and nothing of any domain is left" if idle else ""
    )
    out.write(f"OK: {what} ({len(JobBook(layout.jobs_file).read().jobs)} job(s) known).\n")


def _refuse_in_kubernetes_mode(layout: StateLayout) -> None:
    """Jobs of a cluster with Kubernetes come from the API server, not from cdsim's own records."""
    state = RunState.load(layout)
    if state is not None and state.kubeconfig:
        raise CommandError(
            f"the cluster in {layout.root} runs Kubernetes (cdsim up --kubernetes): create ComputeDomains "
            f"and pods with kubectl (export KUBECONFIG={state.kubeconfig}), not with cdsim job"
        )


def _run(coro: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    asyncio.run(coro())


def dispatch(args: argparse.Namespace, out: TextIO) -> None:
    layout = StateLayout.at(args.state_dir)
    if args.command == "job" and args.job_command in ("submit", "scale"):
        _refuse_in_kubernetes_mode(layout)
    if args.command == "up":
        options = lifecycle.UpOptions(
            racks=args.racks,
            trays=args.trays if args.trays is not None else (KUBE_DEFAULT_TRAYS if args.kubernetes else 18),
            partitions_per_rack=args.partitions_per_rack,
            address_block=args.address_block,
            log_level=args.log_level,
            mesh=args.mesh,
            mesh_certificate_validity_s=args.mesh_certificate_validity_s,
            kubernetes=args.kubernetes,
            secure=not args.plaintext,
            driver_version=next((v for v in args.driver_version if "=" not in v), ""),
            node_driver_versions=tuple(
                (node, version)
                for node, _, version in (v.partition("=") for v in args.driver_version if "=" in v)
            ),
        )
        lifecycle.up(layout, options, out)
        url = dashboard_url(RunState.load(layout))
        if url:
            out.write(f"Live dashboard: {url}\n")
    elif args.command == "down":
        lifecycle.down(layout, out)
    elif args.command == "status":
        _run(lambda: _status(layout, args.json, out))
    elif args.command == "check":
        _run(lambda: _check(layout, args.idle, args.settle, out))
    elif args.command == "job" and args.job_command == "submit":
        submit_options = jobs.SubmitOptions(
            name=args.name,
            num_nodes=args.nodes,
            namespace=args.namespace,
            all_channels=args.all_channels,
            wait=args.wait,
            placement=args.placement,
            prepare_deadline_s=args.timeout,
        )
        _run(lambda: jobs.submit(layout, submit_options, out))
    elif args.command == "job" and args.job_command == "wait":
        wait_options = jobs.WaitOptions(
            name=args.name,
            namespace=args.namespace,
            status=args.status,
            reason=args.reason,
            timeout_s=args.timeout,
        )
        _run(lambda: jobs.wait(layout, wait_options, out))
    elif args.command == "job" and args.job_command == "check":
        check_options = jobs.CheckOptions(name=args.name, namespace=args.namespace)
        _run(lambda: jobs.check_job(layout, check_options, out))
    elif args.command == "job" and args.job_command == "scale":
        scale_options = job_scaling.ScaleOptions(
            name=args.name, num_nodes=args.nodes, namespace=args.namespace, prepare_deadline_s=args.timeout
        )
        _run(lambda: job_scaling.scale(layout, scale_options, out))
    elif args.command == "job" and args.job_command == "delete":
        delete_options = jobs.DeleteOptions(
            name=args.name, namespace=args.namespace, wait=args.wait, timeout_s=args.timeout
        )
        _run(lambda: jobs.delete(layout, delete_options, out))
    elif args.command == "fault":
        if args.fault == "kill-agent":
            faults.kill_agent(layout, args.node, out, args.down_for)
        elif args.fault == "kill-imex-agent":
            faults.kill_imex_agent(layout, args.node, out, args.down_for)
        elif args.fault == "kill-node":
            faults.kill_node(layout, args.node, out, args.down_for)
        elif args.fault == "kill-imex":
            faults.kill_imex(layout, args.node, out)
        elif args.fault == "kill-controller":
            faults.kill_controller(layout, args.replica, out, args.down_for)
        elif args.fault == "partition-etcd":
            faults.partition_etcd(layout, args.node, args.down_for, out)
        elif args.fault == "cut-links":
            faults.cut_links(layout, args.node, args.seconds, out)
        else:
            faults.restart_etcd(layout, out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("console", "warning" if args.verbose else "critical", stream=sys.stderr)
    try:
        dispatch(args, sys.stdout)
    except CommandError as exc:
        sys.stdout.flush()
        print(f"cdsim: {exc}", file=sys.stderr)
        return 1
    except (*TRANSIENT_ERRORS, aetcd.exceptions.ClientError) as exc:
        sys.stdout.flush()
        reason = str(exc) or type(exc).__name__
        print(
            f"cdsim: the cluster's etcd did not answer ({reason}); is it restarting? Try again.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("cdsim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
