"""Fencing of the controller's Kubernetes writes by its leadership.

etcd writes carry the leader key's compare; the apiserver has no such compare, so every mutating
request of the controller's API client first checks that this term's lease is certainly still
valid (`Leadership.may_act`, measured from the last refresh *sent*). A leader that was paused
(SIGSTOP, a long GC, a VM freeze) past its lease finds that out at its next write and makes none.
Objects whose previous state matters are also written with a resourceVersion precondition, so a
write prepared before the pause cannot overwrite a newer leader's.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio.client import ApiClient

from libs.runtime.errors import PermanentError
from libs.state.election import Leadership

_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class NotLeading(PermanentError, RuntimeError):
    """A write was refused: this replica's leadership could have lapsed. Permanent: the election
    ends the term then, and only a new term may write again."""


def fence_writes(api: ApiClient, leadership: Leadership) -> None:
    """Make every mutating request of `api` check `leadership` first (one place for all writes)."""
    request = api.request

    def fenced(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if method.upper() in _MUTATING and not leadership.may_act():
            raise NotLeading(
                f"refused {method} {url}: the leader lease of {leadership.holder} could have lapsed"
            )
        return request(method, url, *args, **kwargs)

    api.request = fenced  # type: ignore[method-assign]
