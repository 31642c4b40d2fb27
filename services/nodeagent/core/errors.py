"""Failure classes of a claim's prepare or unprepare.

Kubelet retries every failed claim; the distinction is ours: a permanent error cannot succeed
on retry as things stand (bad configuration, a namespace violation), so it is logged at error
level and counted apart from retryable ones (the node is busy, the IMEX daemon is not ready
yet, the store is unreachable). Either message goes into the claim's ``error`` string. The two
derive from the project's roots (libs/runtime/errors.py).
"""

from __future__ import annotations

from libs.runtime import errors


class ClaimError(Exception):
    """A claim could not be prepared or unprepared; ``str(exc)`` is what kubelet is told."""

    kind = "error"


class PermanentClaimError(ClaimError, errors.PermanentError):
    """Retrying the same claim will fail the same way until something outside changes."""

    kind = "permanent"


class RetryableClaimError(ClaimError, errors.RetryableError):
    """The same call may succeed later."""

    kind = "retryable"


class ClaimGone(PermanentClaimError):
    """The claim does not exist (any more), or the name now belongs to another UID."""
