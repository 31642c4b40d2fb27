"""The reservations watch's echoes of this advisor's own writes, held back undecoded.

The advisor applies a reservation it wrote as soon as etcd answers the write, and the watch then
reports the same put again. When the answer is handled first, the watch skips the echo by its
revision. When the echo comes first (a busy advisor reads both from one connection), it used to
be decoded and applied, then applied once more by the writer: decoding a record is most of an
echo's cost. An echo of a record this process is writing is instead held here, undecoded, until
the write ends:

- the writer applied the record written at the echo's revision: the echo is that record (one
  key, one revision, one value) and is dropped;
- otherwise (the write failed, timed out or was abandoned after etcd applied it, or another
  writer used the id): the echo is a change nobody applied yet, and is handed back to be
  decoded and applied, in revision order with everything else.

A delete of the record seen while a put is held drops the held put: the delete is newer, and is
applied as it comes.

Pure bookkeeping, no I/O: the fleet index decodes and applies what `end` hands back, as the watch
would have (`libs.state.watch.put_event`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeldEcho:
    key: str
    revision: int
    value: bytes


class OwnEchoes:
    def __init__(self) -> None:
        # reservation id -> the echo held back for it (None: none yet); an id is here while a
        # write of it is in flight.
        self._writing: dict[str, HeldEcho | None] = {}
        # How many echoes were held, and handed back to be applied (tests read them).
        self.held = 0
        self.handed_back = 0

    def begin(self, reservation_id: str) -> None:
        """A write of this reservation starts; from now its echo is held."""
        self._writing.setdefault(reservation_id, None)

    def hold(self, reservation_id: str, key: str, revision: int, value: bytes) -> bool:
        """The watch reports a put of the record: True when it is held (the watch skips it)."""
        if reservation_id not in self._writing:
            return False
        current = self._writing[reservation_id]
        if current is None or revision > current.revision:
            self._writing[reservation_id] = HeldEcho(key, revision, value)
        self.held += 1
        return True

    def deleted(self, reservation_id: str) -> None:
        """The watch reports the record deleted: a held put of it is superseded."""
        if self._writing.get(reservation_id) is not None:
            self._writing[reservation_id] = None

    def end(self, reservation_id: str, applied_revision: int) -> HeldEcho | None:
        """The write is over and the writer applied the record written at `applied_revision` (0:
        nothing): the held echo that still has to be applied, if any."""
        echo = self._writing.pop(reservation_id, None)
        if echo is None or echo.revision == applied_revision:
            return None
        self.handed_back += 1
        return echo

    def __len__(self) -> int:
        return len(self._writing)
