"""The controller's side effects for the IMEX mesh: minting a domain's CA, signing members'
requests, dropping the credentials of nodes that left. Each is one fenced etcd transaction."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.imex import mesh_pki, slots
from libs.state.election import Leadership
from libs.state.store import Absent, Compare, Delete, Op, Put, Store, Unchanged
from services.controller.actions import DeleteMeshCredentials, SecureMesh, SignMeshCertificate
from services.controller.view import StoreView

log = structlog.get_logger(__name__)

FencedTxn = Callable[[list[Compare], list[Op], Leadership], Awaitable[tuple[bool, int]]]


class MeshSigner:
    def __init__(
        self,
        store: Store,
        view: StoreView,
        *,
        certificate_validity_s: float,
        authority_validity_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.view = view
        self.certificate_validity = timedelta(seconds=certificate_validity_s)
        self.authority_validity = timedelta(seconds=authority_validity_s)
        self.clock = clock
        # A domain's CA never changes while the domain exists: read once per domain and term.
        self._authorities: dict[str, tuple[str, int, mesh_pki.DomainAuthority]] = {}

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    async def apply(
        self,
        uid: str,
        action: SecureMesh | SignMeshCertificate | DeleteMeshCredentials,
        leadership: Leadership,
        txn: FencedTxn,
    ) -> bool:
        if isinstance(action, SecureMesh):
            return await self._secure(uid, action, leadership, txn)
        if isinstance(action, SignMeshCertificate):
            return await self._sign(uid, action, leadership, txn)
        k = self.keys
        ok, _ = await txn(
            [Absent(k.member(uid, action.node))],
            [Delete(k.mesh_request(uid, action.node)), Delete(k.mesh_certificate(uid, action.node))],
            leadership,
        )
        if ok:
            log.info("mesh credentials of a non-member dropped", cd_uid=uid, node=action.node)
        return ok

    async def _secure(self, uid: str, action: SecureMesh, leadership: Leadership, txn: FencedTxn) -> bool:
        entry = self.view.domains.get(uid)
        if entry is None or entry.mod_revision != action.domain_revision:
            return False  # the record moved on; its watch event queues the domain again
        k = self.keys
        mode = pb.MeshMode.MUTUAL_TLS if action.mutual_tls else pb.MeshMode.PLAINTEXT
        updated = dataclasses.replace(entry.value, mesh_mode=mode)
        ops: list[Op] = [Put(k.domain(uid), updated)]
        if action.mutual_tls:
            authority = mesh_pki.new_domain_authority(uid, now=self._now(), validity=self.authority_validity)
            ops.append(
                Put(
                    k.mesh_authority(uid),
                    pb.MeshAuthority(
                        domain_uid=uid, ca_cert_pem=authority.cert_pem, ca_key_pem=authority.key_pem
                    ),
                )
            )
        ok, revision = await txn(
            [Unchanged(k.domain(uid), action.domain_revision), Absent(k.mesh_authority(uid))], ops, leadership
        )
        if ok:
            self.view.put_domain(uid, updated, revision)
            log.info(
                "domain mesh decided",
                cd_uid=uid,
                cd=updated.name,
                namespace=updated.namespace,
                mesh="MutualTLS" if action.mutual_tls else "Plaintext",
            )
        return ok

    async def _authority(self, uid: str) -> tuple[str, int, mesh_pki.DomainAuthority] | None:
        cached = self._authorities.get(uid)
        if cached is not None:
            return cached
        ca = await self.store.get(self.keys.mesh_authority(uid), pb.MeshAuthority)
        if ca is None:
            return None
        entry = (ca.key, ca.mod_revision, mesh_pki.DomainAuthority(ca.value.ca_cert_pem, ca.value.ca_key_pem))
        self._authorities[uid] = entry
        return entry

    def forget(self, uid: str) -> None:
        self._authorities.pop(uid, None)

    async def _sign(
        self, uid: str, action: SignMeshCertificate, leadership: Leadership, txn: FencedTxn
    ) -> bool:
        k = self.keys
        member = self.view.members.get(uid, {}).get(action.node)
        request = self.view.mesh.requests.get(uid, {}).get(action.node)
        ca = await self._authority(uid)
        if member is None or request is None or ca is None or request.mod_revision != action.request_revision:
            return False  # something moved; the event that moved it queues the domain again
        ca_key, ca_revision, authority = ca
        slot = slots.slot_name(uid, member.clique_id, member.index)
        try:
            cert_pem = mesh_pki.sign_node_certificate(
                authority,
                request.csr_pem,
                domain_uid=uid,
                node=action.node,
                dns_names=[slot],
                address=member.ip_address,
                now=self._now(),
                validity=self.certificate_validity,
            )
        except mesh_pki.MeshPkiError as exc:
            log.warning("mesh certificate request refused", cd_uid=uid, node=action.node, error=str(exc))
            return False
        not_after = mesh_pki.certificate_facts(cert_pem).not_after
        certificate = pb.MeshCertificate(
            domain_uid=uid,
            node_name=action.node,
            cert_pem=cert_pem,
            ca_cert_pem=authority.cert_pem,
            not_after_unix_ms=int(not_after.timestamp() * 1000),
            request_sha256=request.sha256,
        )
        ok, _ = await txn(
            [
                Unchanged(k.mesh_request(uid, action.node), request.mod_revision),
                Unchanged(k.member(uid, action.node), action.member_revision),
                Unchanged(ca_key, ca_revision),
            ],
            [Put(k.mesh_certificate(uid, action.node), certificate)],
            leadership,
        )
        if not ok:
            self._authorities.pop(uid, None)  # perhaps the CA went with its domain: read it again
        if ok:
            log.info(
                "mesh certificate issued",
                cd_uid=uid,
                node=action.node,
                clique=member.clique_id,
                slot=slot,
                not_after=not_after.isoformat(),
            )
        return ok
