"""structlog configuration shared by every service and tool.

JSON lines in production, readable key=value lines in a terminal. Stable keys
used across the project: cd_uid, cd, namespace, node, claim_uid, clique.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO, cast

import structlog

from libs.runtime.text_limits import MAX_LOG_VALUE_CHARS, clip

LogFormat = Literal["json", "console", "auto"]

# Field names whose values must never reach a log line (tokens, keys, passwords).
_SECRET_KEYS = frozenset({"password", "token", "secret", "private_key", "authorization", "key_pem"})


def _redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if key.lower() in _SECRET_KEYS:
            event[key] = "<redacted>"
    return event


def _clip_long_values(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A value from a caller can be megabytes long; a log line repeats only its start."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > MAX_LOG_VALUE_CHARS:
            event[key] = clip(value, MAX_LOG_VALUE_CHARS)
    return event


class _CurrentStderr:
    """Writes to whatever sys.stderr is at the time of the write.

    Binding the stream object at configure time breaks when it is later
    replaced and closed (pytest's capture does that between tests).
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(fmt: LogFormat = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog once for the process; idempotent."""
    out = stream if stream is not None else _CurrentStderr()
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"invalid log level {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact_secrets,
            _clip_long_values,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, out)),
        cache_logger_on_first_use=False,
    )
