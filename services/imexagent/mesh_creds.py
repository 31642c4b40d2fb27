"""This node's credentials for one domain's IMEX mesh: its own key, its request, its certificate.

The key is made here and never leaves the node: it is written only into the domain directory
(mode 0600), never logged, never put in the store. The request (public) goes to
``meshcsr/<uid>/<node>``; the controller answers it with ``meshcert/<uid>/<node>`` for this
member's slot name and address. Once the certificate is on disk the daemon may start. At two
thirds of its lifetime a new key and request are made; when the new certificate arrives the files
are replaced and the daemon is told to reload (SIGUSR1): the same instance, so imports stay.

A plaintext domain needs none of this. The controller fixes the mode once, on the domain record;
a join copies it into the member record, so the agent usually knows it without reading the domain
(a join that came before the decision leaves it UNDECIDED, and the domain record is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog

from libs.fsio.atomic import write_atomic
from libs.gen.computedomain.state import v1 as pb
from libs.imex import mesh_pki, slots
from libs.imex.config import MeshTlsFiles
from libs.runtime.backoff import Backoff
from libs.state.domain_record import DomainRecord
from libs.state.store import TRANSIENT_ERRORS, Store
from libs.state.watch import PrefixWatcher, Resync, watch_prefix
from services.imexagent.slot_map import Identity

log = structlog.get_logger(__name__)

_PENDING_KEY = mesh_pki.MESH_KEY_FILE + ".next"


def mesh_files(directory: Path) -> MeshTlsFiles:
    return MeshTlsFiles(
        key=str(directory / mesh_pki.MESH_KEY_FILE),
        cert=str(directory / mesh_pki.MESH_CERT_FILE),
        ca=str(directory / mesh_pki.MESH_CA_FILE),
    )


def certificate_fits(cert_pem: bytes, key_pem: bytes, identity: Identity, now: datetime) -> bool:
    """Whether a certificate names this member's slot and address, matches the key and is valid."""
    try:
        facts = mesh_pki.certificate_facts(cert_pem)
        fits_key = mesh_pki.key_matches_certificate(key_pem, cert_pem)
    except mesh_pki.MeshPkiError:
        return False
    slot = slots.slot_name(identity.domain_uid, identity.clique_id, identity.index)
    return (
        fits_key
        and slot in facts.dns_names
        and identity.address in facts.addresses
        and facts.not_before <= now < facts.not_after
    )


class MeshCredentials:
    def __init__(
        self,
        store: Store,
        directory: Path,
        domain_uid: str,
        node_name: str,
        identity: Identity,
        on_change: Callable[[bool], None],
        *,
        renew_fraction: float = 2 / 3,
        io_timeout_s: float = 10.0,
        watch: PrefixWatcher = watch_prefix,
        clock: Callable[[], float] = time.time,
        mode: pb.MeshMode = pb.MeshMode.UNDECIDED,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.dir = directory
        self.uid = domain_uid
        self.node = node_name
        self.identity = identity
        # Called with True when the credentials of a running daemon were replaced (reload it).
        self._on_change = on_change
        self.renew_fraction = renew_fraction
        self.io_timeout_s = io_timeout_s
        self._watch = watch
        self._clock = clock
        # Known from the member record when the join saw it decided; else read from the domain.
        self.mode = mode
        self.issued_for: Identity | None = None  # the identity the certificate on disk names
        self.renew_at = 0.0
        self.rotations = 0
        self._latest: pb.MeshCertificate | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- what the runner asks ------------------------------------------------------------

    def ready_for(self, identity: Identity) -> bool:
        if self.mode == pb.MeshMode.PLAINTEXT:
            return True
        return self.mode == pb.MeshMode.MUTUAL_TLS and self.issued_for == identity

    def files(self) -> MeshTlsFiles | None:
        return mesh_files(self.dir) if self.mode == pb.MeshMode.MUTUAL_TLS else None

    def want(self, identity: Identity) -> None:
        if identity != self.identity:
            self.identity = identity
            self._changed.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"imex-mesh-{self.uid}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None

    # ---- loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(initial=0.2, cap=10.0)
        while True:
            try:
                if self.mode == pb.MeshMode.UNDECIDED:
                    await self._learn_mode()
                if self.mode != pb.MeshMode.MUTUAL_TLS:
                    log.info("IMEX mesh is plaintext", cd_uid=self.uid, node=self.node)
                    self._on_change(False)
                    return
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._follow_certificate())
                    tg.create_task(self._keep_current())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # store trouble or a bad record: log, back off, go on
                delay = backoff.next_delay()
                log.error(
                    "IMEX mesh credentials failed; retrying",
                    cd_uid=self.uid,
                    node=self.node,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)

    async def _learn_mode(self) -> None:
        key = self.keys.domain(self.uid)
        current = await self.store.get(key, DomainRecord)
        if current is not None and current.value.mesh_mode != pb.MeshMode.UNDECIDED:
            self.mode = pb.MeshMode(current.value.mesh_mode)  # the common case: decided long ago
            return
        async for event in self._watch(self.store, key, DomainRecord):
            items = event.items if isinstance(event, Resync) else [event]
            for item in items:
                value = item.value
                if item.key == key and value is not None and value.mesh_mode != pb.MeshMode.UNDECIDED:
                    self.mode = pb.MeshMode(value.mesh_mode)
                    return

    async def _follow_certificate(self) -> None:
        key = self.keys.mesh_certificate(self.uid, self.node)
        async for event in self._watch(self.store, self.keys.mesh_certificates(self.uid), pb.MeshCertificate):
            items = event.items if isinstance(event, Resync) else [event]
            for item in items:
                if item.key == key:
                    self._latest = item.value
                    self._changed.set()

    async def _keep_current(self) -> None:
        await self._blocking(self._adopt_files)
        pending: tuple[str, bytes, Identity] | None = None  # (request digest, key, identity)
        while True:
            self._changed.clear()
            identity = self.identity
            due = self.issued_for != identity or self._clock() >= self.renew_at
            if due and (pending is None or pending[2] != identity):
                pending = await self._request(identity)
            latest = self._latest
            if pending is not None and latest is not None and latest.request_sha256 == pending[0]:
                if await self._install(latest, pending[1], pending[2]):
                    pending = None
                    continue
            timeout = None if due else max(self.renew_at - self._clock(), 0.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()

    async def _request(self, identity: Identity) -> tuple[str, bytes, Identity]:
        key_pem = mesh_pki.new_node_key()
        csr = mesh_pki.certificate_request(key_pem, domain_uid=self.uid, node=self.node)
        await self._blocking(self._write_pending_key, key_pem)
        record = pb.MeshCertificateRequest(
            domain_uid=self.uid, node_name=self.node, csr_pem=csr, requested_unix_ms=int(self._clock() * 1000)
        )
        await self._put(self.keys.mesh_request(self.uid, self.node), record)
        log.info(
            "IMEX mesh certificate requested",
            cd_uid=self.uid,
            node=self.node,
            clique=identity.clique_id,
            renewal=self.issued_for is not None,
        )
        return hashlib.sha256(csr).hexdigest(), key_pem, identity

    async def _put(self, key: str, record: pb.MeshCertificateRequest) -> None:
        backoff = Backoff(initial=0.1, cap=5.0)
        while True:
            try:
                await self.store.put(key, record)
                return
            except TRANSIENT_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("store unavailable; retrying the mesh request", cd_uid=self.uid, error=str(exc))
                await asyncio.sleep(delay)

    async def _install(self, cert: pb.MeshCertificate, key_pem: bytes, identity: Identity) -> bool:
        now = datetime.fromtimestamp(self._clock(), UTC)
        try:
            mesh_pki.verify_issued_by(cert.cert_pem, cert.ca_cert_pem, now=now)
        except mesh_pki.MeshPkiError as exc:
            log.error("IMEX mesh certificate unusable", cd_uid=self.uid, node=self.node, error=str(exc))
            return False
        if not certificate_fits(cert.cert_pem, key_pem, identity, now):
            log.error(
                "IMEX mesh certificate does not name this member's slot and address",
                cd_uid=self.uid,
                node=self.node,
            )
            return False
        await self._blocking(self._write_files, cert)
        rotated = self.issued_for is not None
        self.issued_for = identity
        self._schedule_renewal(cert.cert_pem)
        if rotated:
            self.rotations += 1
        log.info(
            "IMEX mesh certificate installed",
            cd_uid=self.uid,
            node=self.node,
            not_after=mesh_pki.certificate_facts(cert.cert_pem).not_after.isoformat(),
            rotation=rotated,
        )
        self._on_change(rotated)
        return True

    def _schedule_renewal(self, cert_pem: bytes) -> None:
        facts = mesh_pki.certificate_facts(cert_pem)
        now = self._clock()
        self.renew_at = now + (facts.not_after.timestamp() - now) * self.renew_fraction

    # ---- files (blocking) ----------------------------------------------------------------

    def _write_pending_key(self, key_pem: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / _PENDING_KEY, key_pem, 0o600)

    def _write_files(self, cert: pb.MeshCertificate) -> None:
        files = mesh_files(self.dir)
        # The daemon reads these only at start and on SIGUSR1, which comes after all three.
        write_atomic(Path(files.cert), cert.cert_pem, 0o600)
        write_atomic(Path(files.ca), cert.ca_cert_pem, 0o600)
        (self.dir / _PENDING_KEY).replace(files.key)

    def _adopt_files(self) -> None:
        """Credentials already on disk (an agent restart): keep using them while they fit."""
        files = mesh_files(self.dir)
        try:
            cert_pem, key_pem = Path(files.cert).read_bytes(), Path(files.key).read_bytes()
            Path(files.ca).stat()
        except OSError:
            return
        if certificate_fits(cert_pem, key_pem, self.identity, datetime.fromtimestamp(self._clock(), UTC)):
            self.issued_for = self.identity
            self._schedule_renewal(cert_pem)
            self._on_change(False)

    async def _blocking(self, fn: Callable[..., object], *args: object) -> None:
        async with asyncio.timeout(self.io_timeout_s):
            await asyncio.to_thread(fn, *args)
