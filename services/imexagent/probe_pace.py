"""How often a daemon is probed (pure: fed the times, reads no clock).

After a start, an adoption, a SIGUSR1 or a hosts rewrite ("fresh"), things happen soon: the daemon
answers READY, its peers connect. Probing at the fast interval all through that window finds them
at once but costs a probe every ``fast`` seconds per daemon; on a real node a probe is a process
(``nvidia-imex-ctl -q``), and a freshly started daemon spends its first tenths of a second just
starting. So within the window the interval grows with the time since the fresh event: an event
at ``e`` seconds after it is seen at most ``max(fast, growth * e)`` later (never later than
``slow``), and the window costs about ``log(window / fast) / log(1 + growth)`` probes instead of
``window / fast``.

Outside the window a settled daemon (READY and connected to every current member) is probed at
``slow``; a daemon that is still waiting (not READY, a not-ready spell being debounced, or a
member not connected yet: the domain's Ready waits for exactly that) at
``min(slow, max(fast, waiting))`` (0.25 s by default).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProbePace:
    fast: float
    slow: float
    waiting: float = 0.25
    window_s: float = 2.0
    growth: float = 0.25
    fresh_since: float = float("-inf")

    def __post_init__(self) -> None:
        if not 0 < self.waiting:
            raise ValueError(f"probe waiting interval must be > 0, got {self.waiting}")
        if not 0 < self.fast <= self.slow:
            raise ValueError(f"probe intervals need 0 < fast <= slow, got fast={self.fast} slow={self.slow}")
        if self.growth < 0 or self.window_s < 0:
            raise ValueError(f"probe growth and window must be >= 0, got {self.growth}, {self.window_s}")

    def fresh(self, now: float) -> None:
        """A start, adoption, SIGUSR1 or hosts rewrite happened at `now`."""
        self.fresh_since = now

    def is_fresh(self, now: float) -> bool:
        return now < self.fresh_since + self.window_s

    def interval(self, now: float, settled_ready: bool) -> float:
        """Seconds from a probe at `now` to the next one."""
        if self.is_fresh(now):
            return min(max(self.fast, self.growth * (now - self.fresh_since)), self.slow)
        return self.slow if settled_ready else min(self.slow, max(self.fast, self.waiting))
