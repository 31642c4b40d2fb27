"""The soak's timeline: every action, fault and finding with its time since the start (pure).

Printed whole when the soak fails, so that a run can be read back (and replayed with its seed);
the counters are the summary printed when it succeeds.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO


@dataclass(frozen=True)
class Event:
    at_s: float
    kind: str  # "job", "fault", "check", "phase", "note", "violation"
    what: str
    detail: str = ""

    def line(self) -> str:
        detail = f"  {self.detail}" if self.detail else ""
        return f"{self.at_s:9.2f}s  {self.kind:<9} {self.what}{detail}"


@dataclass
class EventLog:
    clock: Callable[[], float] = time.monotonic
    events: list[Event] = field(default_factory=list)
    # What was done ("fault kill-agent", "job submit", ...) and how it ended ("job submit refused").
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    echo: TextIO | None = None
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def add(self, kind: str, what: str, detail: str = "", count: str | None = None) -> Event:
        event = Event(round(self.elapsed(), 2), kind, what, detail)
        self.events.append(event)
        if count:
            self.counts[count] += 1
        if self.echo is not None:
            self.echo.write(event.line() + "\n")
            self.echo.flush()
        return event

    def violation(self, text: str) -> None:
        self.violations.append(text)
        self.add("violation", text)

    def render(self) -> str:
        return "\n".join(event.line() for event in self.events)

    def summary(self, prefix: str) -> list[str]:
        """`count name` lines of the counters starting with `prefix` (sorted by name)."""
        return [
            f"{self.counts[name]:6d}  {name[len(prefix) :]}"
            for name in sorted(self.counts)
            if name.startswith(prefix)
        ]
