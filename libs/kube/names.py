"""Kubernetes' rules for object names, as the API server applies them (RFC 1123).

A namespace is a DNS-1123 label; most kinds, ComputeDomains and ResourceClaims among them, take a
DNS-1123 subdomain. Each check returns None for a valid name, else the rule it breaks.
"""

from __future__ import annotations

import re

from libs.runtime.text_limits import clip

MAX_LABEL_LENGTH = 63
MAX_SUBDOMAIN_LENGTH = 253
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_problem(name: str) -> str | None:
    """Why `name` is not a DNS-1123 label (a namespace), or None."""
    if len(name) > MAX_LABEL_LENGTH:
        return (
            f"{clip(name, 40)!r} is {len(name)} characters; a DNS-1123 label has at most {MAX_LABEL_LENGTH}"
        )
    if not _LABEL.fullmatch(name):
        return (
            f"{clip(name, 40)!r} is not a DNS-1123 label: lower-case letters, digits and '-', "
            "starting and ending with a letter or digit (e.g. 'team-a')"
        )
    return None


def subdomain_problem(name: str) -> str | None:
    """Why `name` is not a DNS-1123 subdomain (most objects' names), or None."""
    if len(name) > MAX_SUBDOMAIN_LENGTH:
        return (
            f"{clip(name, 40)!r} is {len(name)} characters; a DNS-1123 subdomain has at most "
            f"{MAX_SUBDOMAIN_LENGTH}"
        )
    if not _SUBDOMAIN.fullmatch(name):
        return (
            f"{clip(name, 40)!r} is not a DNS-1123 subdomain: lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit (e.g. 'my-job')"
        )
    return None
