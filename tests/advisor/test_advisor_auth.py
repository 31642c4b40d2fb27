"""The advisor with mutual TLS: clients without a certificate of its client CA are refused at the
handshake, on gRPC and on the extender; reservations are charged to the certificate's name, and no
holder gets more reserved nodes than its cap."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.settings import AdvisorSettings
from tests.advisor.fleet import cluster_records, put_nodes
from tests.advisor.harness import running_advisor, settings_for
from tools.controlplane.pki import CertKeyPair, issue_from_ca, new_ca
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=2, trays_per_rack=18, seed="auth-test")
CAP = 20
# How a refused handshake reaches a grpclib client: the connection goes, the call fails.
REFUSED = (OSError, ssl.SSLError, ConnectionError, StreamTerminatedError)


@pytest.fixture
async def seeded(store: Store) -> list[pb.Node]:
    records = cluster_records(CLUSTER)
    await put_nodes(store, records)
    return records


class Pki:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca = new_ca(directory, "clients-ca", "advisor clients")
        self.server = issue_from_ca(
            self.ca,
            directory,
            "server",
            "placement-advisor",
            ip_addresses=("127.0.0.1",),
            server=True,
            client=False,
        )
        self.alice = issue_from_ca(self.ca, directory, "alice", "team-alice")
        self.other_ca = new_ca(directory, "other-ca", "someone else")
        self.mallory = issue_from_ca(self.other_ca, directory, "mallory", "team-alice")

    def client_context(self, pair: CertKeyPair | None, *, alpn: str | None = "h2") -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.cert))  # trusts the server's CA
        if pair is not None:
            context.load_cert_chain(str(pair.cert), str(pair.key))
        if alpn:
            context.set_alpn_protocols([alpn])
        return context


def secured(etcd_config: EtcdConfig, pki: Pki) -> AdvisorSettings:
    return settings_for(
        etcd_config,
        tls_cert_file=str(pki.server.cert),
        tls_key_file=str(pki.server.key),
        tls_client_ca_file=str(pki.ca.cert),
        max_reserved_nodes_per_holder=CAP,
    )


async def _place(port: int, context: ssl.SSLContext, request: pp.PlaceRequest) -> pp.PlaceResponse:
    channel = Channel("127.0.0.1", port, ssl=context)
    try:
        return await pp.PlacementAdvisorStub(channel, timeout=10).place(request)
    finally:
        channel.close()


async def test_grpc_refuses_clients_without_a_certificate_of_its_ca(
    etcd_config: EtcdConfig, seeded: list[pb.Node], tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    async with running_advisor(secured(etcd_config, pki)) as advisor:
        for who, context in (
            ("no certificate", pki.client_context(None)),
            ("another CA", pki.client_context(pki.mallory)),
        ):
            with pytest.raises(REFUSED):
                await _place(advisor.grpc_port, context, pp.PlaceRequest(num_nodes=4))
            assert advisor.service.advisor.fleet.reservations == {}, who
        plain = Channel("127.0.0.1", advisor.grpc_port)  # no TLS at all
        try:
            with pytest.raises(REFUSED):
                await pp.PlacementAdvisorStub(plain, timeout=5).place(pp.PlaceRequest(num_nodes=4))
        finally:
            plain.close()
        reply = await _place(advisor.grpc_port, pki.client_context(pki.alice), pp.PlaceRequest(num_nodes=4))
        assert reply.feasible


async def test_reservations_are_charged_to_the_certificate_and_capped(
    etcd_config: EtcdConfig, seeded: list[pb.Node], tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    alice = pki.client_context(pki.alice)
    async with running_advisor(secured(etcd_config, pki)) as advisor:
        first = await _place(
            advisor.grpc_port, alice, pp.PlaceRequest(num_nodes=16, reserve=True, holder="someone-else")
        )
        assert first.feasible and first.reservation_id
        fleet = advisor.service.advisor.fleet
        assert fleet.reservations[first.reservation_id].holder == "team-alice", (
            "the declared holder is ignored"
        )
        with pytest.raises(GRPCError) as refused:
            await _place(
                advisor.grpc_port, alice, pp.PlaceRequest(num_nodes=8, reserve=True, holder="a-new-name")
            )
        assert refused.value.status == Status.RESOURCE_EXHAUSTED
        assert "team-alice" in str(refused.value.message) and f"cap of {CAP}" in str(refused.value.message)
        held = sum(len(r.node_names) for r in fleet.reservations.values() if r.holder == "team-alice")
        assert held == 16
        # A placement without a reservation costs nothing and is still answered.
        assert (await _place(advisor.grpc_port, alice, pp.PlaceRequest(num_nodes=8))).feasible


async def test_a_ttl_above_the_cap_is_refused_by_name(
    etcd_config: EtcdConfig, seeded: list[pb.Node], tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    async with running_advisor(secured(etcd_config, pki)) as advisor:
        with pytest.raises(GRPCError) as refused:
            await _place(
                advisor.grpc_port,
                pki.client_context(pki.alice),
                pp.PlaceRequest(num_nodes=2, reserve=True, reservation_ttl_seconds=3600),
            )
        assert refused.value.status == Status.INVALID_ARGUMENT
        assert "reservation_ttl_seconds" in str(refused.value.message) and "600" in str(refused.value.message)


async def test_the_extender_requires_a_client_certificate(
    etcd_config: EtcdConfig, seeded: list[pb.Node], tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    args = {"Pod": {"metadata": {"name": "p", "namespace": "default"}}, "Nodes": None, "NodeNames": ["a"]}
    async with running_advisor(secured(etcd_config, pki)) as advisor:
        url = f"https://127.0.0.1:{advisor.service.extender_port}/filter"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.post(url, json=args, ssl=pki.client_context(None, alpn=None)) as response:
                    await response.read()
            async with http.post(url, json=args, ssl=pki.client_context(pki.alice, alpn=None)) as response:
                assert response.status == 200
                assert (await response.json())["NodeNames"] == ["a"]


def test_mutual_tls_needs_all_three_files() -> None:
    with pytest.raises(
        ValueError, match="needs all of --tls-cert-file, --tls-key-file and --tls-client-ca-file"
    ):
        AdvisorSettings(tls_cert_file="server.crt")
