"""A full run with etcd TLS client certificates and password auth: sockets, secrets in logs.

One secured cluster (tests/security/secured_cluster.py: etcd with client-cert auth and a
least-privilege etcd user, two controllers, the advisor, three nodes each with its IMEX agent and
kubelet plugin, all at log level debug, started under umask 0) is shared by the tests of this
module, which run in order: the plugins' sockets -> a job placed, prepared, Ready, unprepared and
torn down -> a plugin and an IMEX agent with a wrong password -> every service stopped, and no
password, private key or token in any log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aetcd import rpc

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_cluster_idle
from libs.state.config import EtcdConfig
from libs.state.store import Delete, Put, Store
from tests import address_blocks
from tests.polling import PollTimeout, eventually, wait_until
from tests.security.leaks import ETCD_TOKEN, find_leaks, key_bodies
from tests.security.secured_cluster import (
    CLIENT_OF_KIND,
    PREFIX,
    SERVICE_USER,
    SecuredCluster,
    create,
    destroy,
    enable_etcd_auth,
    service_specs,
)
from tools.cdsim import advisor, jobs, kubelet
from tools.cdsim.job_book import Job
from tools.cdsim.layout import cluster_node_paths
from tools.cdsim.services import ServiceSpec, agent_name, imex_agent_name

pytestmark = pytest.mark.slow

TRAYS = 4  # three nodes run; the fourth is for the programs with a wrong password
WRONG_PASSWORD_NODE = f"rack0-tray{TRAYS - 1}"
ADDRESS_BLOCK = address_blocks.SECURED_RUN


@pytest.fixture(scope="module")
def secured(etcd_bin: Path) -> Iterator[SecuredCluster]:
    cluster = create(TRAYS, ADDRESS_BLOCK, etcd_bin)
    try:
        cluster.etcd.start()
        admin = cluster.clients["admin"]
        bootstrap = EtcdConfig(
            endpoint=cluster.etcd.endpoint,
            prefix=PREFIX,
            ca_file=str(cluster.ca.cert),
            cert_file=str(admin.cert),
            key_file=str(admin.key),
        )
        asyncio.run(enable_etcd_auth(bootstrap, cluster.password))
        specs = [s for s in service_specs(cluster) if s.node != WRONG_PASSWORD_NODE]
        for spec in specs:
            # One replica takes the password as a flag, every other service from the environment.
            cluster.start(spec, CLIENT_OF_KIND[spec.kind], password_as_flag=spec.name == "controller-1")
        cluster.wait_healthy([s.name for s in specs])
        yield cluster
    finally:
        destroy(cluster)


def _running_agents(cluster: SecuredCluster) -> list[str]:
    return [s.node for s in cluster.specs.values() if s.kind == "agent" and s.node != WRONG_PASSWORD_NODE]


def test_node_agent_sockets_are_not_world_writable(secured: SecuredCluster) -> None:
    for node in _running_agents(secured):
        dirs = secured.layout.node(node)
        for socket in (dirs.dra_socket, dirs.registration_socket):
            # /healthz answers before the agent has registered its node and opened the
            # kubelet sockets; give it the time it takes.
            wait_until(socket.exists, f"{node}'s agent to open {socket.name}", 60)
            info = socket.stat()
            assert stat.S_ISSOCK(info.st_mode), f"{socket} is not a socket"
            mode = stat.S_IMODE(info.st_mode)
            # Started under umask 0: the agent sets these modes itself.
            assert not mode & stat.S_IWOTH, f"{socket} is world-writable ({oct(mode)})"
            parent = stat.S_IMODE(socket.parent.stat().st_mode)
            assert not parent & stat.S_IWOTH, (
                f"{socket.parent} is world-writable ({oct(parent)}): the socket could be replaced"
            )


async def test_a_job_runs_end_to_end_over_tls_with_password_auth(secured: SecuredCluster) -> None:
    nodes = _running_agents(secured)
    uid = str(uuid.uuid4())
    async with Store(secured.store_config("admin")) as store:
        # Healthy is not yet registered: wait until every running IMEX agent has its node record.
        async def all_registered() -> bool:
            registered, _ = await store.list(store.keys.nodes(), pb.Node)
            return sorted(r.value.name for r in registered) == sorted(nodes)

        await eventually(all_registered, f"node records of {sorted(nodes)}", 60)
    placement = await advisor.place(
        secured.advisor_endpoint, len(nodes), uid, "single-clique", "security-test"
    )
    assert sorted(placement.nodes) == sorted(nodes)
    job = Job(
        name="secure",
        namespace="team-a",
        domain_uid=uid,
        num_nodes=len(nodes),
        allocation_mode="Single",
        state="submitting",
        created_unix_ms=int(time.time() * 1000),
        claims=jobs.plan_claims("secure", "team-a", placement.nodes),
    )
    async with Store(secured.store_config("admin")) as store:
        assert await store.create(store.keys.domain(uid), jobs.build_domain(job, job.created_unix_ms))
        await store.txn(
            [], [Put(store.keys.claim(c.uid), jobs.build_claim(c, uid, "Single", 0)) for c in job.claims]
        )
        calls = [jobs.claim_call(secured.layout, c) for c in job.claims]
        prepared = await asyncio.gather(*(kubelet.prepare(call, 60.0) for call in calls))
        assert all(o.ok for o in prepared), [o.errors for o in prepared]
        await advisor.release(secured.advisor_endpoint, placement.reservation_id, holder="security-test")
        ready = await jobs.wait_domain(
            store, uid, lambda d: d is not None and d.status.status == pb.Readiness.READY, 60.0
        )
        assert ready is not None

        unprepared = await asyncio.gather(*(kubelet.unprepare(call, 60.0) for call in calls))
        assert all(o.ok for o in unprepared), [o.errors for o in unprepared]
        await store.txn([], [Delete(store.keys.claim(c.uid)) for c in job.claims])

        def mark_deleting(domain: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
            if domain is None:
                return None
            domain.deleting = True
            return domain

        await store.update(store.keys.domain(uid), pb.ComputeDomain, mark_deleting)
        await jobs.wait_domain(store, uid, lambda d: d is None, 60.0)
        paths = cluster_node_paths(secured.layout, nodes)
        leftovers: list[str] = []

        async def idle() -> bool:
            nonlocal leftovers
            leftovers = await check_cluster_idle(store, paths)
            return not leftovers

        await eventually(idle, "the cluster to be idle", 20.0, explain=lambda: f"leftovers: {leftovers}")


@pytest.mark.parametrize("program", [agent_name, imex_agent_name], ids=["plugin", "imex-agent"])
def test_an_agent_with_a_wrong_password_is_refused(
    secured: SecuredCluster, program: Callable[[str], str]
) -> None:
    spec = next(s for s in service_specs(secured) if s.name == program(WRONG_PASSWORD_NODE))
    name = f"{spec.kind}-wrong-password"
    wrong = "wrong-" + secured.password[::-1]
    process = secured.start(_renamed(spec, name), CLIENT_OF_KIND[spec.kind], password=wrong)
    with contextlib.suppress(PollTimeout):  # the assertion below names what the log says
        wait_until(
            lambda: (
                process.poll() is not None
                or "authentication failed" in secured.log_file(name).read_text(errors="replace").lower()
            ),
            f"{name} to log its refusal or exit",
            20.0,
        )
    secured.stop(name)
    log = secured.log_file(name).read_text(errors="replace")
    assert "authentication failed" in log.lower(), log[-2000:]
    assert wrong not in log


def _renamed(spec: ServiceSpec, name: str) -> ServiceSpec:
    return ServiceSpec(
        name, spec.kind, spec.target, spec.argv, spec.health_url, spec.restart_delay_s, spec.node
    )


async def _a_real_etcd_token(cluster: SecuredCluster) -> str:
    async with Store(cluster.store_config("admin")) as store:
        auth = rpc.AuthStub(store.client.channel)
        answer = await auth.Authenticate(
            rpc.AuthenticateRequest(name=SERVICE_USER, password=cluster.password), timeout=5
        )
        return str(answer.token)


def test_no_password_key_or_token_in_any_log_line(secured: SecuredCluster) -> None:
    token = asyncio.run(_a_real_etcd_token(secured))
    assert ETCD_TOKEN.fullmatch(token), f"etcd token format changed: {token!r}; update ETCD_TOKEN"
    secured.stop_all()
    logs = secured.service_logs()
    assert {"controller-0", "controller-1", "advisor"} <= set(logs)
    assert sum(1 for name in logs if name.startswith("agent-rack")) == len(_running_agents(secured))
    assert sum(1 for name in logs if name.startswith("imex-rack")) == len(_running_agents(secured))
    # The services did run at debug level and talk about etcd: the logs are not trivially empty.
    assert all(len(text.splitlines()) >= 5 for text in logs.values()), {k: len(v) for k, v in logs.items()}
    keys = key_bodies(secured.private_key_files())
    assert keys
    leaks = find_leaks(logs, keys, {"the etcd password": secured.password})
    assert not leaks, "\n".join(leaks)
