"""The node agent's prepare checkpoint: which claims this node prepared, survived across restarts.

One JSON file in the plugin directory (``<kubelet dir>/plugins/compute-domain.nvidia.com/
checkpoint.json``), replaced atomically on every change::

    {"version": 1, "bootID": "...", "checksum": "sha256:...",
     "entries": {"<claim uid>": {"state": "PrepareStarted" | "PrepareCompleted", ...}},
     "tombstones": {"<claim uid>": {"expiresAt": <unix s>, "claimVersion": ...}}}

The checksum covers the canonical JSON (sorted keys, compact) of everything but itself, so a
torn or hand-edited file is detected. A corrupt file is moved aside (``checkpoint.json.corrupt-
<UTC timestamp>``) and the agent starts empty, rebuilding from the store. Entries from a previous
boot are discarded: after a reboot the CDI files (tmpfs), the IMEX daemons and kubelet's own view
are gone, and kubelet prepares again.

NVIDIA's compute-domain plugin keeps its checkpoint at the same path. Found there on our first
start, it is migrated (``services/nodeagent/core/nvidia_checkpoint.py`` reads it): its bytes are kept
as ``checkpoint.json.nvidia-<stamp>``, its claims become entries with ``migratedFrom`` set, and our
file replaces it. One we cannot read is moved aside unchanged as ``checkpoint.json.nvidia-
refused-<stamp>``, and nothing is migrated.

Tombstones keep unprepared claims refused for a short while (default 5 min), so a prepare that
was already in flight when its unprepare ran cannot resurrect the claim (upstream #1162). A
tombstone may carry the claim's version (Kubernetes resourceVersion, or the store revision in
simulation) seen at prepare time: a later prepare of the same claim at another version (a shared
claim reused by a new pod) is then not refused.

Every change goes through one call that applies it and saves: :meth:`Checkpoint.update` (a
blocking save), or ``CheckpointWriter.update`` (services/nodeagent/shell/checkpoint_writer.py: saves
coalesced with concurrent changes, off the event loop). A change whose save fails is undone in
memory, so memory never holds a change that the file lacks because its write failed: the
caller's retry finds the state as it was and repeats the whole step (a failed completion must
not leave the claim looking prepared to the next prepare call).

Concurrency: the class is plain synchronous state. Use it from one asyncio task at a time; it
does no locking itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import structlog

from libs.contract.names import DRIVER_NAME
from libs.fsio.atomic import fsync_dir, write_atomic
from libs.runtime.errors import PermanentError
from services.nodeagent.core.json_members import JsonMembers
from services.nodeagent.core.nvidia_checkpoint import (
    NvidiaCheckpointError,
    looks_like_nvidia_checkpoint,
    map_claims,
    parse_nvidia_checkpoint,
)

log = structlog.get_logger(__name__)

CHECKPOINT_VERSION = 1
CHECKPOINT_FILENAME = "checkpoint.json"
DEFAULT_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
DEFAULT_TOMBSTONE_TTL_S = 300.0

T = TypeVar("T")


def checkpoint_path(kubelet_dir: Path) -> Path:
    return kubelet_dir / "plugins" / DRIVER_NAME / CHECKPOINT_FILENAME


class ClaimState(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class ClaimEntry:
    claim_uid: str
    state: ClaimState
    namespace: str
    name: str
    domain_uid: str
    node: str
    claim_version: str | None
    cdi_device_ids: tuple[str, ...]
    request_names: tuple[str, ...]
    started_at: float
    completed_at: float | None
    # Set for a claim taken over from NVIDIA's checkpoint (e.g. "nvidia-v2"): it has no store
    # record and made no membership of ours, so it never stands for the node's membership.
    migrated_from: str | None = None


@dataclass(frozen=True)
class Tombstone:
    claim_uid: str
    expires_at: float
    claim_version: str | None


class StalePrepareError(PermanentError):
    """A prepare for a claim that was unprepared moments ago (refuse it; do not resurrect)."""

    def __init__(self, claim_uid: str, detail: str) -> None:
        super().__init__(f"claim {claim_uid}: {detail}")
        self.claim_uid = claim_uid


class _CorruptCheckpoint(PermanentError):
    pass


@dataclass(frozen=True)
class Change:
    """What one update did, claim by claim: each touched claim's entry and tombstone before it
    and after it (None: none). Enough to undo it while nothing else changed those claims."""

    before: Mapping[str, tuple[ClaimEntry | None, Tombstone | None]]
    after: Mapping[str, tuple[ClaimEntry | None, Tombstone | None]]


class Checkpoint:
    """In-memory checkpoint state bound to its file; :meth:`save` persists it."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id: str,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
        entries: Iterable[ClaimEntry] = (),
        tombstones: Iterable[Tombstone] = (),
    ) -> None:
        self.path = path
        self.boot_id = boot_id
        self.tombstone_ttl_s = tombstone_ttl_s
        # Wall clock, not monotonic: tombstone expiries must mean the same after a restart.
        self._clock = clock
        self._entries: dict[str, ClaimEntry] = {e.claim_uid: e for e in entries}
        self._tombstones: dict[str, Tombstone] = {t.claim_uid: t for t in tombstones}
        self._fragments: dict[str, tuple[ClaimEntry, str]] = {}
        # The canonical tombstones section, changed with each tombstone, and the earliest expiry:
        # a save must not walk the thousands an unprepare burst leaves.
        self._tombstone_text = JsonMembers()
        for tomb in self._tombstones.values():
            self._tombstone_text.set(tomb.claim_uid, _tombstone_member(tomb))
        self._earliest_expiry: float | None = None
        # The claims' states before the change being applied (see `apply`), while one is.
        self._before: dict[str, tuple[ClaimEntry | None, Tombstone | None]] | None = None

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: Path,
        boot_id_path: Path = DEFAULT_BOOT_ID_PATH,
        *,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
        node: str = "",
    ) -> Checkpoint:
        """Read the checkpoint at ``path``. A corrupt file is moved aside, never raised about.

        A file in NVIDIA's format (the first start after NVIDIA's plugin) is migrated: see
        :meth:`_take_over_nvidia`; ``node`` is this node's name, recorded in migrated entries."""
        boot_id = read_boot_id(boot_id_path)
        empty = cls(path, boot_id=boot_id, tombstone_ttl_s=tombstone_ttl_s, clock=clock)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            log.info("no checkpoint file; starting empty", path=str(path))
            return empty
        try:
            saved_boot_id, entries, tombstones = _decode(raw)
        except _CorruptCheckpoint as exc:
            # Not ours: NVIDIA's (the first start after its plugin), checked only now so that
            # every other start parses the file once.
            if looks_like_nvidia_checkpoint(raw):
                return cls._take_over_nvidia(empty, raw, node)
            moved_to = _move_aside(path)
            log.error(
                "checkpoint corrupt (neither this agent's format nor NVIDIA's); moved aside, "
                "starting empty (state is rebuilt from the store)",
                path=str(path),
                moved_to=str(moved_to),
                reason=str(exc),
            )
            return empty
        if boot_id and saved_boot_id and saved_boot_id != boot_id:
            log.warning(
                "node rebooted since checkpoint was written; discarding its entries",
                path=str(path),
                saved_boot_id=saved_boot_id,
                boot_id=boot_id,
                discarded_claims=sorted(e.claim_uid for e in entries),
            )
            return empty
        checkpoint = cls(
            path,
            boot_id=boot_id or saved_boot_id,
            tombstone_ttl_s=tombstone_ttl_s,
            clock=clock,
            entries=entries,
            tombstones=tombstones,
        )
        checkpoint.prune_tombstones()
        return checkpoint

    @classmethod
    def _take_over_nvidia(cls, empty: Checkpoint, raw: bytes, node: str) -> Checkpoint:
        """Migrate NVIDIA's checkpoint, which sits where ours goes (same plugin directory, same
        file name), into ours: first start after NVIDIA's driver.

        Its bytes are first copied, unchanged and durably, to ``checkpoint.json.nvidia-<UTC
        stamp>``; only then is our checkpoint written over the original path (one atomic
        replace), so a crash in between repeats the migration and nothing is ever lost. A file
        that cannot be read (checksum mismatch, unknown version, malformed) is moved aside
        unchanged as ``checkpoint.json.nvidia-refused-<stamp>`` and nothing is migrated. Claims
        from a previous boot (V2 nodeBootID) are void, as for NVIDIA's plugin itself.
        """
        path = empty.path
        try:
            parsed = parse_nvidia_checkpoint(raw)
        except NvidiaCheckpointError as exc:
            moved_to = _move_aside(path, "nvidia-refused")
            log.error(
                "NVIDIA driver checkpoint refused; moved aside unchanged, nothing migrated, starting empty",
                path=str(path),
                moved_to=str(moved_to),
                reason=str(exc),
            )
            return empty
        kept = _keep_copy(path, raw, "nvidia")
        if parsed.boot_id and empty.boot_id and parsed.boot_id != empty.boot_id:
            log.warning(
                "NVIDIA driver checkpoint is from a previous boot; its claims are void, nothing migrated",
                path=str(path),
                kept_copy=str(kept),
                saved_boot_id=parsed.boot_id,
                boot_id=empty.boot_id,
            )
            mapped = []
        else:
            mapped = map_claims(parsed)
        now = empty._clock()
        origin = f"nvidia-{parsed.version}"
        for claim in mapped:
            empty._entries[claim.claim_uid] = ClaimEntry(
                claim_uid=claim.claim_uid,
                state=ClaimState.PREPARE_COMPLETED if claim.completed else ClaimState.PREPARE_STARTED,
                namespace=claim.namespace,
                name=claim.name,
                domain_uid=claim.domain_uid,
                node=node,
                claim_version=None,
                cdi_device_ids=claim.cdi_device_ids if claim.completed else (),
                request_names=claim.request_names if claim.completed else (),
                started_at=now,
                completed_at=now if claim.completed else None,
                migrated_from=origin,
            )
            if claim.problem is None:
                log.info(
                    "claim migrated from NVIDIA driver checkpoint",
                    claim_uid=claim.claim_uid,
                    cd_uid=claim.domain_uid,
                    state="PrepareCompleted" if claim.completed else "PrepareStarted",
                    node=node,
                )
            else:
                log.warning(
                    "claim from NVIDIA driver checkpoint cannot be mapped; kept only so kubelet can unprepare it",
                    claim_uid=claim.claim_uid,
                    namespace=claim.namespace,
                    name=claim.name,
                    reason=claim.problem,
                    node=node,
                )
        empty.save()  # our format over NVIDIA's file: from now on this checkpoint is ours
        log.info(
            "NVIDIA driver checkpoint migrated",
            path=str(path),
            kept_copy=str(kept),
            version=parsed.version,
            claims=len(mapped),
            unmapped=sum(1 for c in mapped if c.problem is not None),
            node=node,
        )
        return empty

    # ---- queries -------------------------------------------------------------------------

    @property
    def entries(self) -> Mapping[str, ClaimEntry]:
        return MappingProxyType(self._entries)

    @property
    def tombstones(self) -> Mapping[str, Tombstone]:
        return MappingProxyType(self._tombstones)

    def get(self, claim_uid: str) -> ClaimEntry | None:
        return self._entries.get(claim_uid)

    def prepared_claims_of_domain(self, domain_uid: str) -> list[ClaimEntry]:
        """Claims of ``domain_uid`` held on this node, started or completed (both hold the
        membership: the join happens after PrepareStarted), sorted by claim UID."""
        return sorted(
            (e for e in self._entries.values() if e.domain_uid == domain_uid),
            key=lambda e: e.claim_uid,
        )

    def is_tombstoned(
        self, claim_uid: str, now: float | None = None, *, claim_version: str | None = None
    ) -> bool:
        """True if a prepare of ``claim_uid`` (at ``claim_version``, if known) must be refused.

        A tombstone without a version, or a caller without one, refuses any prepare of the UID.
        """
        tomb = self._tombstones.get(claim_uid)
        if tomb is None or tomb.expires_at <= (self._clock() if now is None else now):
            return False
        return tomb.claim_version is None or claim_version is None or tomb.claim_version == claim_version

    # ---- changes ------------------------------------------------------------------------------

    def update(self, mutate: Callable[[Checkpoint], T]) -> T:
        """Apply ``mutate`` (calls of the ``mark_*`` and ``remove`` methods below) and save,
        blocking. Returns what ``mutate`` returned. If ``mutate`` or the save raises, the change
        is undone in memory and the exception propagates: nothing is half-done."""
        result, change = self.apply(mutate)
        try:
            self.save()
        except BaseException:
            self.revert(change)
            raise
        return result

    def apply(self, mutate: Callable[[Checkpoint], T]) -> tuple[T, Change]:
        """Apply ``mutate`` in memory only, returning its result and the :class:`Change` that
        undoes it; for a saver that persists it (``update``, ``CheckpointWriter.update``). A
        ``mutate`` that raises has its partial change undone."""
        if self._before is not None:
            raise RuntimeError("checkpoint changes do not nest: one update at a time")
        self._before = {}
        try:
            result = mutate(self)
            before = self._before
        except BaseException:
            self.revert(Change(before=self._before, after=self._states(self._before)))
            raise
        finally:
            self._before = None
        return result, Change(before=before, after=self._states(before))

    def revert(self, change: Change) -> None:
        """Undo ``change`` for each claim that no later change touched (its state is still what
        the change left); a later change built on it stands or falls with its own save."""
        for uid, (entry, tomb) in change.before.items():
            now_entry, now_tomb = self._state(uid)
            after_entry, after_tomb = change.after[uid]
            if now_entry is not after_entry or now_tomb is not after_tomb:
                continue
            if entry is None:
                self._entries.pop(uid, None)
            else:
                self._entries[uid] = entry
            if tomb is None:
                if self._tombstones.pop(uid, None) is not None:
                    self._tombstone_text.discard(uid)
            else:
                self._tombstones[uid] = tomb
                self._tombstone_text.set(uid, _tombstone_member(tomb))
            self._earliest_expiry = None  # recomputed at the next prune

    def _state(self, uid: str) -> tuple[ClaimEntry | None, Tombstone | None]:
        return self._entries.get(uid), self._tombstones.get(uid)

    def _states(self, uids: Iterable[str]) -> dict[str, tuple[ClaimEntry | None, Tombstone | None]]:
        return {uid: self._state(uid) for uid in uids}

    def _touch(self, uid: str) -> None:
        """Note the claim's state before a change to it (first touch per update only)."""
        if self._before is not None and uid not in self._before:
            self._before[uid] = self._state(uid)

    def mark_prepare_started(
        self,
        claim_uid: str,
        *,
        namespace: str,
        name: str,
        domain_uid: str,
        node: str,
        claim_version: str | None = None,
    ) -> ClaimEntry:
        """Record that preparing the claim began. Returns the entry now in effect.

        A claim already PrepareCompleted is left as it is (a repeated prepare must not regress
        it). Raises :class:`StalePrepareError` if the claim was unprepared recently.
        """
        existing = self._entries.get(claim_uid)
        if existing is not None and existing.state is ClaimState.PREPARE_COMPLETED:
            return existing
        if self.is_tombstoned(claim_uid, claim_version=claim_version):
            raise StalePrepareError(claim_uid, "unprepared recently; refusing a stale prepare")
        self._touch(claim_uid)
        if self._tombstones.pop(claim_uid, None) is not None:
            self._tombstone_text.discard(claim_uid)
            self._earliest_expiry = None
        entry = ClaimEntry(
            claim_uid=claim_uid,
            state=ClaimState.PREPARE_STARTED,
            namespace=namespace,
            name=name,
            domain_uid=domain_uid,
            node=node,
            claim_version=claim_version,
            cdi_device_ids=(),
            request_names=(),
            started_at=existing.started_at if existing is not None else self._clock(),
            completed_at=None,
        )
        self._entries[claim_uid] = entry
        return entry

    def mark_prepare_completed(
        self,
        claim_uid: str,
        cdi_device_ids: Iterable[str],
        *,
        request_names: Iterable[str] = (),
        claim_version: str | None = None,
    ) -> ClaimEntry:
        """Record that the claim is prepared, with what kubelet was told.

        Raises :class:`StalePrepareError` if the claim was unprepared while this prepare ran
        (its entry is gone or now belongs to another version of the claim), ``KeyError`` if
        the prepare was never started.
        """
        entry = self._entries.get(claim_uid)
        if entry is None:
            if claim_uid in self._tombstones:
                raise StalePrepareError(claim_uid, "unprepared while being prepared")
            raise KeyError(f"claim {claim_uid}: prepare completed without being started")
        if claim_version is not None and entry.claim_version not in (None, claim_version):
            raise StalePrepareError(
                claim_uid, f"prepare of version {claim_version} superseded by version {entry.claim_version}"
            )
        self._touch(claim_uid)
        completed = replace(
            entry,
            state=ClaimState.PREPARE_COMPLETED,
            cdi_device_ids=tuple(cdi_device_ids),
            request_names=tuple(request_names),
            completed_at=self._clock(),
        )
        self._entries[claim_uid] = completed
        return completed

    def remove(self, claim_uid: str, *, claim_version: str | None = None) -> ClaimEntry | None:
        """Drop the claim's entry (unprepare) and leave a tombstone against stale prepares.

        The tombstone takes the entry's claim version, else ``claim_version``. Returns the
        removed entry, or None if there was none (still tombstoned: a prepare may be in flight).
        """
        self._touch(claim_uid)
        entry = self._entries.pop(claim_uid, None)
        version = entry.claim_version if entry is not None and entry.claim_version else claim_version
        tomb = Tombstone(
            claim_uid=claim_uid, expires_at=self._clock() + self.tombstone_ttl_s, claim_version=version
        )
        self._tombstones[claim_uid] = tomb
        self._tombstone_text.set(claim_uid, _tombstone_member(tomb))
        if self._earliest_expiry is not None:
            self._earliest_expiry = min(self._earliest_expiry, tomb.expires_at)
        return entry

    def prune_tombstones(self, now: float | None = None) -> int:
        """Forget expired tombstones; returns how many."""
        now = self._clock() if now is None else now
        if self._earliest_expiry is None:
            self._earliest_expiry = min((t.expires_at for t in self._tombstones.values()), default=None)
        if self._earliest_expiry is None or self._earliest_expiry > now:
            return 0
        expired = [uid for uid, t in self._tombstones.items() if t.expires_at <= now]
        for uid in expired:
            del self._tombstones[uid]
            self._tombstone_text.discard(uid)
        # A lower bound until now (a replaced tombstone may have held it): make it exact.
        self._earliest_expiry = min((t.expires_at for t in self._tombstones.values()), default=None)
        return len(expired)

    # ---- persistence ---------------------------------------------------------------------

    def save(self) -> None:
        """Persist atomically (temp file, fsync, rename, fsync dir). Changes go through
        :meth:`update`; this alone writes a checkpoint as loaded or migrated."""
        self.prune_tombstones()
        self.write(self.encode())

    def write(self, data: bytes) -> None:
        """Write encoded content atomically and durably (blocking: fsync)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, data, mode=0o600)

    def encode(self) -> bytes:
        """The file content (see :func:`sign`)."""
        return sign(self.unsigned_text())

    def unsigned_text(self) -> str:
        """Same text as ``_canonical`` of the document without its checksum, but built from
        per-entry fragments cached while entries are unchanged (entries are immutable)."""
        fragments: dict[str, tuple[ClaimEntry, str]] = {}
        parts: list[str] = []
        for uid in sorted(self._entries):
            entry = self._entries[uid]
            cached = self._fragments.get(uid)
            fragment = (
                cached[1] if cached is not None and cached[0] is entry else _canonical(_entry_to_json(entry))
            )
            fragments[uid] = (entry, fragment)
            parts.append(f"{_canonical(uid)}:{fragment}")
        self._fragments = fragments
        return (
            f'{{"bootID":{_canonical(self.boot_id)},"entries":{{{",".join(parts)}}},'
            f'"tombstones":{{{self._tombstone_text.text()}}},"version":{CHECKPOINT_VERSION}}}'
        )


def sign(unsigned: str) -> bytes:
    """The file content for the canonical text of everything but the checksum: the checksum
    covers that text and is appended as the last key, so the text is produced once. Pure, so
    the checkpoint writer hashes off the event loop."""
    checksum = "sha256:" + hashlib.sha256(unsigned.encode()).hexdigest()
    return f'{unsigned[:-1]},"checksum":"{checksum}"}}'.encode()


def read_boot_id(path: Path) -> str:
    """The kernel boot id, or "" if unreadable (reboot detection is then off, with a warning)."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        log.warning("cannot read boot id; reboot detection disabled", path=str(path), error=str(exc))
        return ""


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _checksum(body: Mapping[str, Any]) -> str:
    unsigned = {k: v for k, v in body.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(_canonical(unsigned).encode()).hexdigest()


def _aside_name(path: Path, label: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return path.with_name(f"{path.name}.{label}-{stamp}")


def _move_aside(path: Path, label: str = "corrupt") -> Path:
    target = _aside_name(path, label)
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def _keep_copy(path: Path, raw: bytes, label: str) -> Path:
    """A durable copy of ``raw`` beside ``path`` (the original stays until it is replaced)."""
    target = _aside_name(path, label)
    write_atomic(target, raw, mode=0o600)
    return target


def _entry_to_json(e: ClaimEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "state": e.state.value,
        "namespace": e.namespace,
        "name": e.name,
        "domainUID": e.domain_uid,
        "node": e.node,
        "claimVersion": e.claim_version,
        "cdiDeviceIDs": list(e.cdi_device_ids),
        "requestNames": list(e.request_names),
        "startedAt": e.started_at,
        "completedAt": e.completed_at,
    }
    if e.migrated_from is not None:
        # Only when set: files without migrated claims stay as they were.
        doc["migratedFrom"] = e.migrated_from
    return doc


def _tombstone_to_json(t: Tombstone) -> dict[str, Any]:
    return {"expiresAt": t.expires_at, "claimVersion": t.claim_version}


def _tombstone_member(t: Tombstone) -> str:
    return f"{_canonical(t.claim_uid)}:{_canonical(_tombstone_to_json(t))}"


def _decode(raw: bytes) -> tuple[str, list[ClaimEntry], list[Tombstone]]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _CorruptCheckpoint(f"invalid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise _CorruptCheckpoint("top level is not an object")
    if doc.get("version") != CHECKPOINT_VERSION:
        raise _CorruptCheckpoint(f"unsupported version {doc.get('version')!r} (want {CHECKPOINT_VERSION})")
    checksum = doc.get("checksum")
    if checksum != _checksum(doc):
        raise _CorruptCheckpoint(f"checksum mismatch (file says {checksum!r})")
    try:
        boot_id = _typed(doc["bootID"], str)
        entries = [_entry_from_json(uid, v) for uid, v in _typed(doc["entries"], dict).items()]
        tombstones = [
            Tombstone(
                claim_uid=uid,
                expires_at=float(_typed(v["expiresAt"], (int, float))),
                claim_version=_optional_str(v.get("claimVersion")),
            )
            for uid, v in _typed(doc.get("tombstones", {}), dict).items()
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise _CorruptCheckpoint(f"malformed content: {exc!r}") from exc
    return boot_id, entries, tombstones


def _entry_from_json(uid: str, v: Any) -> ClaimEntry:
    v = _typed(v, dict)
    completed_at = v.get("completedAt")
    return ClaimEntry(
        claim_uid=uid,
        state=ClaimState(v["state"]),
        namespace=_typed(v["namespace"], str),
        name=_typed(v["name"], str),
        domain_uid=_typed(v["domainUID"], str),
        node=_typed(v["node"], str),
        claim_version=_optional_str(v.get("claimVersion")),
        cdi_device_ids=tuple(_typed(x, str) for x in _typed(v.get("cdiDeviceIDs", []), list)),
        request_names=tuple(_typed(x, str) for x in _typed(v.get("requestNames", []), list)),
        started_at=float(_typed(v["startedAt"], (int, float))),
        completed_at=None if completed_at is None else float(_typed(completed_at, (int, float))),
        migrated_from=_optional_str(v.get("migratedFrom")),
    )


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"unexpected {type(value).__name__} value {value!r}")
    return value


def _optional_str(value: Any) -> str | None:
    return None if value is None else _typed(value, str)
