"""Finding secrets in log lines: passwords, private keys, etcd auth tokens, bearer tokens, JWTs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

# etcd's default ("simple") auth token: 16 letters, a dot, an index.
ETCD_TOKEN = re.compile(r"\b[A-Za-z]{16}\.\d+\b")
BEARER = re.compile(r"bearer\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
JWT = re.compile(r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}")
PEM_PRIVATE = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")


def key_bodies(key_files: Iterable[Path]) -> dict[str, str]:
    """The longest base64 line of each PEM private key, by file name: what a leak would contain."""
    return {path.name: max(path.read_text().splitlines(), key=len) for path in key_files}


def find_leaks(logs: Mapping[str, str], keys: Mapping[str, str], secrets: Mapping[str, str]) -> list[str]:
    """Every log line (`name.log:number: what: line`) that holds a secret: a value of `secrets`
    (by what it is), a line of `keys` (by key file), or anything shaped like a private key or token."""
    leaks = []
    for name, text in logs.items():
        for number, line in enumerate(text.splitlines(), 1):
            found = [
                what
                for what, hit in (
                    *((what, value in line) for what, value in secrets.items()),
                    ("a private key PEM", bool(PEM_PRIVATE.search(line))),
                    ("an etcd auth token", bool(ETCD_TOKEN.search(line))),
                    ("a bearer token", bool(BEARER.search(line))),
                    ("a JWT", bool(JWT.search(line))),
                    *((f"key material of {k}", body in line) for k, body in keys.items()),
                )
                if hit
            ]
            if found:
                leaks.append(f"{name}.log:{number}: {', '.join(found)}: {line[:200]}")
    return leaks
