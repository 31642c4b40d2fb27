"""Capped exponential backoff with jitter, for every retry loop."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays initial, initial*factor, ... capped at `cap`, with +/- `jitter` fraction."""

    initial: float = 0.05
    cap: float = 5.0
    factor: float = 2.0
    jitter: float = 0.2
    _attempt: int = field(default=0, init=False)

    def next_delay(self) -> float:
        base = min(self.cap, self.initial * (self.factor**self._attempt))
        self._attempt += 1
        spread = base * self.jitter
        return max(0.0, min(self.cap, base + random.uniform(-spread, spread)))

    def reset(self) -> None:
        self._attempt = 0

    @property
    def attempts(self) -> int:
        return self._attempt
