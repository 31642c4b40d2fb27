"""A plain-text progress bar: redrawn in place on a terminal, a few lines otherwise."""

from __future__ import annotations

import time
from typing import TextIO

BAR_WIDTH = 30
# Without a terminal, print at most one line per this many seconds (plus the last one).
LOG_INTERVAL_S = 1.0


def render_bar(done: int, total: int, label: str, width: int = BAR_WIDTH) -> str:
    filled = width if total <= 0 else min(width, done * width // total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"


class Progress:
    def __init__(self, total: int, label: str, out: TextIO) -> None:
        self.total = total
        self.label = label
        self.out = out
        self.done = 0
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._last_line_at = 0.0
        self._last_len = 0

    def advance(self, note: str = "") -> None:
        self.done += 1
        self.show(note)

    def show(self, note: str = "") -> None:
        line = render_bar(self.done, self.total, self.label) + (f"  {note}" if note else "")
        if self.tty:
            padding = " " * max(0, self._last_len - len(line))
            self.out.write("\r" + line + padding)
            self._last_len = len(line)
            if self.done >= self.total:
                self.out.write("\n")
            self.out.flush()
            return
        now = time.monotonic()
        if self.done >= self.total or now - self._last_line_at >= LOG_INTERVAL_S:
            self.out.write(line + "\n")
            self.out.flush()
            self._last_line_at = now
