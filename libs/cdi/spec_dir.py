"""Claim spec files in a CDI root: write (atomically), remove, list.

Synchronous on purpose: a write or a removal is a few small syscalls, cheaper than a hop to a
thread pool on the prepare path. Atomic but not fsynced, removals neither: the container runtime
reads the spec right after the prepare, from the page cache; a machine crash voids every prepared
claim anyway (the checkpoint is discarded on a new boot id), and CDI roots are tmpfs on most nodes
(/var/run/cdi), where an fsync does nothing. On a disk-backed root the flushes blocked the agent's
event loop. A removal that a machine crash undoes leaves a spec of a claim the agent does not
hold, which its start-up reconcile removes. Not safe for two writers of the same claim at once;
the node agent serializes per claim.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import structlog

from libs.cdi.spec import (
    MAX_CHANNELS,
    claim_cdi_device_id,
    claim_spec_basename,
    render_claim_spec,
    validate_claim_uid,
)
from libs.fsio.atomic import remove_stale_temps, write_atomic

log = structlog.get_logger(__name__)

DEFAULT_CDI_ROOT = Path("/var/run/cdi")
SPEC_EXTENSIONS = (".json", ".yaml")
_CLAIM_FILE_PREFIX = claim_spec_basename("")


class ClaimSpecDir:
    """The claim spec files of our driver in one CDI root directory."""

    def __init__(
        self,
        root: Path = DEFAULT_CDI_ROOT,
        *,
        host_dev_root: str | PurePosixPath | None = None,
        file_mode: int = 0o644,
    ) -> None:
        self.root = root
        self.host_dev_root = host_dev_root
        self.file_mode = file_mode
        self._root_exists = False

    def path_for(self, claim_uid: str) -> Path:
        return self.root / f"{claim_spec_basename(claim_uid)}.json"

    def write(self, claim_uid: str, *, channels: Sequence[int], major: int | None) -> str:
        """Write (or replace) the claim's spec; return its CDI device id.

        ``channels`` empty means a non-fabric node (see :func:`build_claim_spec`).
        """
        data = render_claim_spec(claim_uid, channels=channels, major=major, host_dev_root=self.host_dev_root)
        if not self._root_exists:
            self.root.mkdir(parents=True, exist_ok=True)
            self._root_exists = True
        path = self.path_for(claim_uid)
        write_atomic(path, data, mode=self.file_mode, durable=False)
        log.debug("cdi spec written", claim_uid=claim_uid, path=str(path), channels=len(channels))
        return claim_cdi_device_id(claim_uid)

    def prewarm(self, major: int) -> None:
        """Encode the allocationMode All device-node array now (a few ms, once per process)
        so the first All prepare does not pay for it. Call at agent start once the major is known."""
        render_claim_spec(
            "prewarm", channels=range(MAX_CHANNELS), major=major, host_dev_root=self.host_dev_root
        )

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec (any encoding). Missing is success; returns whether one existed."""
        validate_claim_uid(claim_uid)
        base = claim_spec_basename(claim_uid)
        removed = False
        for ext in SPEC_EXTENSIONS:
            try:
                os.unlink(self.root / f"{base}{ext}")
            except FileNotFoundError:
                continue
            removed = True
        if removed:
            log.debug("cdi spec removed", claim_uid=claim_uid)
        return removed

    def claim_uids(self) -> list[str]:
        """UIDs of the claims that have a spec file here (sorted), for reconcile at start.

        Only finished files count: temp files of an interrupted write are hidden ``.tmp`` names.
        """
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return []
        uids: set[str] = set()
        for name in names:
            stem, dot, ext = name.rpartition(".")
            if not dot or f".{ext}" not in SPEC_EXTENSIONS or not stem.startswith(_CLAIM_FILE_PREFIX):
                continue
            uid = stem[len(_CLAIM_FILE_PREFIX) :]
            if uid and _is_valid_uid(uid):
                uids.add(uid)
        return sorted(uids)

    def remove_stale_temps(self) -> list[Path]:
        """Delete temp files a crash left in the root (ours only). Call before serving."""
        removed = remove_stale_temps(self.root, _CLAIM_FILE_PREFIX)
        for path in removed:
            log.info("removed stale cdi temp file", path=str(path))
        return removed


def _is_valid_uid(uid: str) -> bool:
    try:
        validate_claim_uid(uid)
    except ValueError:
        return False
    return True
