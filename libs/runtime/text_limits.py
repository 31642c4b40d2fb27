"""Bounds on untrusted text: how much of it an error or a log line repeats, and length checks.

A caller may send a megabyte where a name belongs; the refusal names the field and the limit and
repeats only the start of the value, so that errors and log lines stay small.
"""

from __future__ import annotations

# How much of an untrusted value an error message or a log field repeats.
MAX_ECHO_CHARS = 128
# Longest string value a log line carries (longer ones are clipped by the logging setup).
MAX_LOG_VALUE_CHARS = 2048


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text, cut to `limit` characters with a note of the full length when longer."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} chars)"


def too_long(value: str | bytes, limit: int) -> str | None:
    """None if `value` fits in `limit` bytes (UTF-8); else the refusal's wording (without the field)."""
    size = len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return None
    return f"{size} bytes long; the limit is {limit} bytes"
