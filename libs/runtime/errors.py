"""The two roots of the project's own exceptions: permanent or retryable.

Every exception class a service or library defines for a failure derives from one of them, so
a caller decides what to do from the root, not from a list of types:

- `RetryableError`: the same call may succeed later with nothing changed by the caller: what it
  waits for (the store, a peer, another node leaving a domain, a free index) changes by itself.
  Retry with backoff and a cap.
- `PermanentError`: the same call fails the same way until its input, a record or the code
  changes (bad configuration, a refused or unreadable value, a broken invariant). Report it;
  retrying as is only repeats it.

Third-party exceptions (aetcd's, asyncio's, OSError) cannot derive from these roots; where they
mean "retryable" a module lists them once (``libs.state.store.TRANSIENT_ERRORS``).
Classes that were already raised as a built-in type keep that type as a second base, so that
existing ``except ValueError`` or ``except RuntimeError`` handlers still see them.
"""

from __future__ import annotations


class RetryableError(Exception):
    """The same call may succeed later; retry it with backoff."""

    kind = "retryable"


class PermanentError(Exception):
    """The same call fails the same way until something outside it changes."""

    kind = "permanent"
