"""Bounds on untrusted text: clipped echoes, length refusals, and log lines that stay short."""

from __future__ import annotations

import io
import json

import structlog
from hypothesis import given
from hypothesis import strategies as st

from libs.runtime.logging import configure_logging
from libs.runtime.text_limits import MAX_ECHO_CHARS, MAX_LOG_VALUE_CHARS, clip, too_long


@given(st.text(max_size=400))
def test_clip_keeps_short_text_and_cuts_long_text_noting_its_length(text: str) -> None:
    clipped = clip(text)
    if len(text) <= MAX_ECHO_CHARS:
        assert clipped == text
    else:
        assert clipped.startswith(text[:MAX_ECHO_CHARS]) and f"({len(text)} chars)" in clipped
        assert len(clipped) < MAX_ECHO_CHARS + 30


def test_too_long_counts_utf8_bytes() -> None:
    assert too_long("a" * 253, 253) is None
    assert too_long("é" * 127, 253) == "254 bytes long; the limit is 253 bytes"
    assert too_long(b"x" * 10, 9) == "10 bytes long; the limit is 9 bytes"


def test_a_megabyte_value_is_clipped_in_the_log_line() -> None:
    out = io.StringIO()
    saved = structlog.get_config()
    configure_logging("json", "info", stream=out)
    try:
        structlog.get_logger("t").warning("bad input", claim_uid="u" * 1024 * 1024)
    finally:
        structlog.configure(**saved)
    line = json.loads(out.getvalue())
    assert line["claim_uid"].startswith("u" * MAX_LOG_VALUE_CHARS)
    assert line["claim_uid"].endswith(f"({1024 * 1024} chars)")
    assert len(out.getvalue()) < MAX_LOG_VALUE_CHARS + 200
