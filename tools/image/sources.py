"""The Debian mirrors of this machine, for the image's base root filesystem (tools/image/base.sh).

The base is built with mmdebstrap from the mirror the machine itself uses, so no mirror host is
written in the repo. This reads the machine's apt sources (one-line `.list` and deb822 `.sources`
files), keeps the Debian archive entries for the suite, its -updates and its -security, and prints
them as one-line entries mmdebstrap takes as MIRROR arguments. Third-party repositories (signed
by another keyring, or not under a /debian or /debian-security path) are left out: their keys are
not in the chroot. It prints nothing when no entry fits; mmdebstrap then uses its default mirrors.

    python -m tools.image.sources bookworm [SOURCES_DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEBIAN_KEYRING = "debian-archive-keyring"
ARCHIVE_PATHS = ("/debian", "/debian-security")


@dataclass(frozen=True)
class Entry:
    uri: str
    suite: str
    components: tuple[str, ...]
    signed_by: str = ""

    def line(self) -> str:
        return f"deb {self.uri} {self.suite} {' '.join(self.components)}"


def parse_one_line(text: str) -> Iterator[Entry]:
    """`deb [options] URI SUITE COMPONENT...` lines; deb-src and comments are skipped."""
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        signed_by = ""
        if words and words[0].startswith("["):
            options: list[str] = []
            while words:
                word = words.pop(0)
                options.append(word.strip("[]"))
                if word.endswith("]"):
                    break
            signed_by = next((o.split("=", 1)[1] for o in options if o.startswith("signed-by=")), "")
        if len(words) >= 3:
            yield Entry(words[0], words[1], tuple(words[2:]), signed_by)


def parse_deb822(text: str) -> Iterator[Entry]:
    """Stanzas of `Types`, `URIs`, `Suites`, `Components`, `Signed-By`; `Enabled: no` is skipped."""
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for raw in stanza.splitlines():
            if raw.startswith("#") or not raw.strip():
                continue
            if raw[0].isspace() and key:
                fields[key] += " " + raw.strip()
                continue
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        components = tuple(fields.get("components", "").split())
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                yield Entry(uri, suite, components, fields.get("signed-by", ""))


def source_files(directory: Path) -> list[Path]:
    """apt's own order: sources.list, then sources.list.d/*.list and *.sources by name."""
    found = [directory / "sources.list"] if (directory / "sources.list").is_file() else []
    parts = directory / "sources.list.d"
    if parts.is_dir():
        found += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources") and p.is_file())
    return found


def read_entries(directory: Path) -> list[Entry]:
    entries: list[Entry] = []
    for path in source_files(directory):
        text = path.read_text(errors="replace")
        entries += parse_deb822(text) if path.suffix == ".sources" else parse_one_line(text)
    return entries


def is_debian_archive(entry: Entry) -> bool:
    if entry.signed_by:
        return DEBIAN_KEYRING in entry.signed_by
    return entry.uri.rstrip("/").endswith(ARCHIVE_PATHS)


def mirror_lines(entries: Iterable[Entry], suite: str) -> list[str]:
    """The suite's Debian archive entries (main only: the base needs nothing else), deduplicated."""
    wanted = {suite, f"{suite}-updates", f"{suite}-security"}
    out: list[str] = []
    for entry in entries:
        if entry.suite in wanted and "main" in entry.components and is_debian_archive(entry):
            line = Entry(entry.uri.rstrip("/"), entry.suite, ("main",)).line()
            if line not in out:
                out.append(line)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("suite", help="the Debian suite of the base, e.g. bookworm")
    parser.add_argument("sources_dir", nargs="?", default="/etc/apt", type=Path, help="apt's directory")
    args = parser.parse_args(argv)
    if not args.suite.isalnum():
        parser.error(f"suite must be a Debian release name like bookworm, got {args.suite!r}")
    for line in mirror_lines(read_entries(args.sources_dir), args.suite):
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main()
