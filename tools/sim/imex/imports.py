"""The memory a simulated daemon's local jobs imported from peers, and when it stops being valid.

A CUDA process imports memory that another node exported through that node's IMEX daemon. The
import stays usable while the exporting daemon is the same *instance*: a restarted daemon has
forgotten its exports, so every importer drops what it imported from the old instance (the job
then fails with "invalid resource handle"). A plain reconnect of the same instance (a network
blip, SIGUSR1 on either side) invalidates nothing. A daemon stopped with SIGTERM tells its peers
(BYE) that its exports are gone. With IMEX_NODE_DISCONNECTED_GRACE_TIME set, an exporter that stays
disconnected that long is cleaned up (``grace.DisconnectClock``).

Pure: the daemon feeds it what it sees in handshakes and BYEs. Imported by the daemon at
start-up: no imports at run time.
"""

from __future__ import annotations


class ImportEntry:
    __slots__ = ("instance", "job", "node_id", "reason", "valid")

    def __init__(self, job: str, node_id: int, instance: str) -> None:
        self.job = job
        self.node_id = node_id
        self.instance = instance  # the exporter's instance when the import was made
        self.valid = True
        self.reason = ""

    def invalidate(self, reason: str) -> None:
        if self.valid:
            self.valid = False
            self.reason = reason


class ImportTable:
    """(job, exporter node ID) -> the import; invalid entries are kept so the job can tell."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], ImportEntry] = {}

    def add(self, job: str, node_id: int, instance: str) -> ImportEntry:
        """Record (or renew) the job's import from ``node_id``, whose instance is ``instance``."""
        entry = ImportEntry(job, node_id, instance)
        self.entries[(job, node_id)] = entry
        return entry

    def remove_job(self, job: str) -> int:
        """Drop every import of ``job``; returns how many there were."""
        keys = [key for key in self.entries if key[0] == job]
        for key in keys:
            del self.entries[key]
        return len(keys)

    def exporter_seen(self, node_id: int, instance: str) -> list[ImportEntry]:
        """A handshake showed ``node_id`` running ``instance``: imports of any other are gone."""
        hit = []
        for entry in self.entries.values():
            if entry.node_id == node_id and entry.valid and entry.instance != instance:
                entry.invalidate(
                    f"exporter node {node_id} restarted (instance {entry.instance} -> {instance})"
                )
                hit.append(entry)
        return hit

    def exporter_gone(self, node_id: int, instance: str) -> list[ImportEntry]:
        """``node_id``'s ``instance`` said BYE (shut down): its exports are gone."""
        hit = []
        for entry in self.entries.values():
            if entry.node_id == node_id and entry.valid and entry.instance == instance:
                entry.invalidate(f"exporter node {node_id} shut down (instance {instance})")
                hit.append(entry)
        return hit

    def exporter_disconnected(self, node_id: int, grace_s: int) -> list[ImportEntry]:
        """``node_id`` stayed disconnected for the grace time: its references are cleaned up."""
        hit = []
        for entry in self.entries.values():
            if entry.node_id == node_id and entry.valid:
                entry.invalidate(
                    f"exporter node {node_id} disconnected for {grace_s} s "
                    "(IMEX_NODE_DISCONNECTED_GRACE_TIME): cleaned up"
                )
                hit.append(entry)
        return hit

    def listing(self) -> list[ImportEntry]:
        return sorted(self.entries.values(), key=lambda e: (e.job, e.node_id))
