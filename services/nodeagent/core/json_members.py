"""The members of a canonical JSON object as text, kept in key order and changed one key at a time.

The checkpoint is saved as canonical JSON (sorted keys) after every prepare and unprepare, and
an unprepare burst leaves thousands of tombstones behind. Re-sorting and re-walking all of them
for each save cost more than the rest of the save; here a change costs a binary search and a
list insert, and the object's text is one join, made only when something changed.
"""

from __future__ import annotations

from bisect import bisect_left


class JsonMembers:
    """``"key":value`` texts of one JSON object, in the order ``json.dumps(sort_keys=True)`` uses."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._texts: list[str] = []
        self._joined: str | None = ""

    def set(self, key: str, member: str) -> None:
        """Add or replace the member of `key` (`member` is its whole ``"key":value`` text)."""
        i = bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            self._texts[i] = member
        else:
            self._keys.insert(i, key)
            self._texts.insert(i, member)
        self._joined = None

    def discard(self, key: str) -> None:
        i = bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            del self._keys[i]
            del self._texts[i]
            self._joined = None

    def text(self) -> str:
        """The members joined with commas (no braces)."""
        if self._joined is None:
            self._joined = ",".join(self._texts)
        return self._joined

    def __len__(self) -> int:
        return len(self._keys)
