"""How long a leader may still act on its lease (pure; the caller passes the clock).

etcd starts a lease's TTL when it handles the grant or keep-alive, which is after this process
sent it. So validity is measured from the moment the request was *sent*: sent_at + TTL is a time
the lease cannot outlive. A leader stops acting `margin_s` before that instant, and each refresh
may take no longer than the validity left, so a refresh that hangs never carries a leader past
its lease (the split brain a fixed refresh timeout of TTL/2 allowed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LeaseValidity:
    ttl_s: float
    margin_s: float
    valid_until: float = float("-inf")

    def granted(self, sent_at: float, ttl_s: float | None = None) -> None:
        """A grant or keep-alive sent at `sent_at` succeeded with `ttl_s` (default: the full TTL)."""
        until = sent_at + (self.ttl_s if ttl_s is None else ttl_s)
        self.valid_until = max(self.valid_until, until)

    def may_act(self, now: float) -> bool:
        return now < self.valid_until - self.margin_s

    def refresh_timeout(self, now: float) -> float:
        """Deadline of a refresh sent now: at most TTL/2, never past the end of acting (<= 0: stop)."""
        return min(self.ttl_s / 2, self.valid_until - self.margin_s - now)
