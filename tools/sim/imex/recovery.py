"""The simulated daemon's persistence file and its recovery wait after an unclean stop.

NVIDIA's IMEX guide ("Connections, Quorum, and Clean up", and IMEX_WAIT_FOR_QUORUM in "IMEX
Service Config Options"): nvidia-imex keeps ``/var/run/nvidia-imex/persist.dat``, a key
generated from the nodes config and the ``Node #: ip address`` of every node that imported its
memory (only the key when no importer is outstanding). A daemon that was not shut down cleanly
waits, after its restart, until every node listed there has reconnected, so that they can clean
up their references to the memory of the instance that died; only then is it ready.
``IMEX_WAIT_FOR_QUORUM=NONE`` turns the wait off, and a changed nodes config discards the file.

The simulator follows that, choosing the stricter reading where the guide is silent:

* the file lives beside ``config.cfg`` (the IMEX agent's domain directory, also the daemon's
  working directory), as ``persist.dat``;
* an importer is recorded when a peer's job imports from this daemon, and dropped when that job
  unimports, or the peer says BYE or shows a new instance (its references are gone either way);
* a clean stop (SIGTERM) leaves only the importers of a *previous* instance that have not
  reconnected yet: its own importers were told (BYE). A crash, SIGKILL or a killed node leaves
  the file as it was: every importer outstanding;
* an outstanding importer counts as reconnected when node ID and address both match its line
  (a node ID now at another address is not the node that imported); until every one has, the
  daemon is ``WAITING_FOR_RECOVERY``, with no time limit;
* a file that cannot be parsed is discarded with a warning, like one of another nodes config.

`Recovery` and the text format are pure; `load` and `save` do the file I/O. Imported by the
daemon at start-up: only ``os`` at run time.
"""

from __future__ import annotations

import os

PERSIST_FILE = "persist.dat"
_KEY_PREFIX = "key="


def render(key: str, importers: dict[int, str]) -> str:
    """The file's text: the nodes config key, then one ``<node ID>: <address>`` per importer."""
    lines = [_KEY_PREFIX + key]
    lines += [f"{node_id}: {address}" for node_id, address in sorted(importers.items())]
    return "\n".join(lines) + "\n"


def parse(text: str) -> tuple[str, dict[int, str]]:
    """(key, importers) of a file's text. ValueError naming the bad line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith(_KEY_PREFIX) or len(lines[0]) == len(_KEY_PREFIX):
        raise ValueError("the first line is not the nodes config key (key=<digest>)")
    importers: dict[int, str] = {}
    for line in lines[1:]:
        raw_id, sep, address = line.partition(":")
        if not sep or not raw_id.strip().isdigit() or not address.strip():
            raise ValueError(f"bad importer line {line!r} (want '<node ID>: <address>')")
        importers[int(raw_id)] = address.strip()
    return lines[0][len(_KEY_PREFIX) :], importers


class Recovery:
    """Who imports this daemon's memory, and which importers of the instance before it must
    reconnect before it is ready.

    ``previous`` is the text of the persistence file found at start (None: no file). The
    decision and its reason (for the log) are fixed at construction."""

    def __init__(self, key: str, wait: bool, previous: str | None, own_id: int, node_count: int) -> None:
        self.key = key
        self.importers: dict[int, tuple[str, set[str]]] = {}  # node ID -> (address, jobs)
        self.outstanding: dict[int, str] = {}  # previous instance's importers not yet reconnected
        self.total = 0  # how many the wait started with
        self.mismatched: set[int] = set()  # reconnected from another address (logged once)
        self.decision = self._decide(key, wait, previous, own_id, node_count)

    def _decide(self, key: str, wait: bool, previous: str | None, own_id: int, node_count: int) -> str:
        if previous is None:
            return "no persistence file: nothing to recover"
        try:
            old_key, importers = parse(previous)
        except ValueError as exc:
            return f"persistence file unreadable, discarded: {exc}"
        if old_key != key:
            return "the nodes config changed since the persistence file was written: discarded"
        bad = sorted(i for i in importers if i == own_id or not 0 <= i < node_count)
        for node_id in bad:
            del importers[node_id]
        if not importers:
            return "no outstanding importers: nothing to recover"
        if not wait:
            return (
                f"{len(importers)} outstanding importer(s) after an unclean stop, not waited for "
                "(IMEX_WAIT_FOR_QUORUM=NONE)"
            )
        self.outstanding = importers
        self.total = len(importers)
        return (
            "not shut down cleanly: waiting for the nodes that imported its memory to reconnect: "
            + self.describe()
        )

    @property
    def waiting(self) -> bool:
        return bool(self.outstanding)

    def describe(self) -> str:
        return ", ".join(f"node {i} ({address})" for i, address in sorted(self.outstanding.items()))

    def reconnected(self, node_id: int, address: str) -> bool:
        """A handshake with `node_id` at `address`; True when it completes the recovery."""
        expected = self.outstanding.get(node_id)
        if expected is None:
            return False
        if expected != address:
            self.mismatched.add(node_id)
            return False
        del self.outstanding[node_id]
        return not self.outstanding

    def imported(self, node_id: int, address: str, job: str) -> bool:
        """A job on `node_id` imported memory of this daemon; True if the importers changed."""
        known = self.importers.get(node_id)
        if known is not None and known[0] == address:
            changed = job not in known[1]
            known[1].add(job)
            return changed
        self.importers[node_id] = (address, {job})
        return True

    def unimported(self, node_id: int, job: str) -> bool:
        """The job on `node_id` dropped its imports; True if the importers changed."""
        known = self.importers.get(node_id)
        if known is None or job not in known[1]:
            return False
        known[1].discard(job)
        if not known[1]:
            del self.importers[node_id]
        return True

    def importer_gone(self, node_id: int) -> bool:
        """`node_id` restarted or shut down: its references are gone; True if that changed them."""
        return self.importers.pop(node_id, None) is not None

    def persisted(self, *, shutting_down: bool = False) -> str:
        """What the file must say now: the outstanding importers of the instance before, and
        (unless this is a clean stop, which told them) this instance's own importers."""
        entries = dict(self.outstanding)
        if not shutting_down:
            for node_id, (address, _) in self.importers.items():
                entries.setdefault(node_id, address)
        return render(self.key, entries)


def load(path: str) -> str | None:
    """The persistence file's text (None if there is none). OSError if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def save(path: str, text: str) -> None:
    """Replace the file atomically (temp file and rename: a crash leaves the old or the new).

    Not fsynced: it must outlive the daemon process, whose writes the page cache keeps; a
    machine crash empties the real daemon's /var/run anyway."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
