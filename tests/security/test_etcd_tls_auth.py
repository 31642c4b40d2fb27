"""The store over etcd with TLS client certificates and username/password auth, end to end."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import aetcd.exceptions
import pytest
from aetcd import rpc

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.logging import configure_logging
from libs.state.config import EtcdConfig
from libs.state.store import Store
from libs.state.watch import Resync, WatchEvent, watch_prefix
from tools.controlplane.pki import generate_pki, issue_from_ca
from tools.etcd.server import EtcdServer

PASSWORD = "s3cret-Pa55word-for-test"


@pytest.fixture
def tls_etcd(etcd_bin: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    pki = generate_pki(tmp_path / "pki", service_ip="10.0.0.1")
    # etcd serves TLS and its embedded gateway dials itself with the same certificate.
    serving = issue_from_ca(
        pki.ca, tmp_path / "pki", "etcd", "etcd", ip_addresses=("127.0.0.1",), server=True
    )
    server = EtcdServer(
        data_dir=tmp_path / "etcd-data",
        binary=etcd_bin,
        cert_file=serving.cert,
        key_file=serving.key,
        trusted_ca_file=pki.ca.cert,
        client_cert_auth=True,
    )
    server.start()
    yield server, pki
    server.destroy()


async def test_store_with_client_certificates_and_password_auth(tls_etcd) -> None:  # type: ignore[no-untyped-def]
    server, pki = tls_etcd
    tls = dict(ca_file=str(pki.ca.cert), cert_file=str(pki.admin.cert), key_file=str(pki.admin.key))

    # Client certificate: reads, writes and watches work over TLS.
    async with Store(EtcdConfig(endpoint=server.endpoint, prefix="/sec/", **tls)) as store:
        await store.put(store.keys.node("n1"), pb.Node(name="n1"))
        got = await store.get(store.keys.node("n1"), pb.Node)
        assert got is not None and got.value.name == "n1"
        it = watch_prefix(store, store.keys.nodes(), pb.Node).__aiter__()
        first = await it.__anext__()
        assert isinstance(first, Resync) and [i.value.name for i in first.items] == ["n1"]
        await store.put(store.keys.node("n2"), pb.Node(name="n2"))
        event = await asyncio.wait_for(it.__anext__(), 5)
        assert isinstance(event, WatchEvent) and event.value is not None and event.value.name == "n2"
        await it.aclose()

        # Turn on etcd authentication: a root user with a password.
        auth = rpc.AuthStub(store.client.channel)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=PASSWORD), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)

    # Without a client certificate the TLS handshake is refused.
    no_cert = Store(
        EtcdConfig(endpoint=server.endpoint, prefix="/sec/", ca_file=str(pki.ca.cert), timeout_s=2)
    )
    with pytest.raises(aetcd.exceptions.ClientError):
        await no_cert.get(no_cert.keys.node("n1"), pb.Node)
    await no_cert.close()

    # A wrong password is refused.
    wrong = Store(
        EtcdConfig(
            endpoint=server.endpoint, prefix="/sec/", username="root", password="nope", timeout_s=2, **tls
        )
    )
    with pytest.raises(aetcd.exceptions.ClientError):
        await wrong.get(wrong.keys.node("n1"), pb.Node)
    await wrong.close()

    # Certificate + password: works, and the password never reaches a log line.
    buffer = io.StringIO()
    configure_logging("json", "debug", stream=buffer)
    try:
        config = EtcdConfig(
            endpoint=server.endpoint, prefix="/sec/", username="root", password=PASSWORD, **tls
        )
        assert PASSWORD not in repr(config)
        async with Store(config) as store:
            await store.put(store.keys.node("n3"), pb.Node(name="n3"))
            items, _ = await store.list(store.keys.nodes(), pb.Node)
            assert [i.value.name for i in items] == ["n1", "n2", "n3"]
            await store.put_raw(store.keys.node("bad"), b"garbage")
            await store.list(store.keys.nodes(), pb.Node)  # logs the undecodable value
    finally:
        configure_logging("console", "info")
    logged = buffer.getvalue()
    assert "skipping undecodable value" in logged
    assert PASSWORD not in logged
