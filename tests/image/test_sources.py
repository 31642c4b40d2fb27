"""The image's base takes its Debian mirror from the machine's apt sources (tools/image/sources.py):
the suite, -updates and -security of the Debian archive, never a third-party repository (its key
is not in the chroot), and nothing when the machine has none (mmdebstrap's default then)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.image.sources import main, mirror_lines, read_entries

REPO = Path(__file__).resolve().parents[2]

DEB822 = """\
Types: deb
# a comment
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb deb-src
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By:
 /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
Enabled: no
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
"""

THIRD_PARTY = """\
Types: deb
URIs: https://download.vendor.example/linux/debian
Suites: bookworm
Components: main stable
Signed-By: /etc/apt/keyrings/vendor.gpg
"""

ONE_LINE = """\
# deb http://commented.example/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://other.example/debian/ bookworm main
deb http://old.example/debian bookworm-updates main non-free
deb-src http://old.example/debian bookworm main
deb http://repo.vendor.example/apt bookworm main
deb http://old.example/debian bookworm contrib
"""


def apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_debian_entries_of_the_suite_in_apts_order_and_nothing_else(tmp_path: Path) -> None:
    directory = apt_dir(
        tmp_path,
        {
            "sources.list": ONE_LINE,
            "sources.list.d/debian.sources": DEB822,
            "sources.list.d/vendor.sources": THIRD_PARTY,
            "sources.list.d/google.list.disabled-by-admin": "deb http://x.example/debian bookworm main\n",
        },
    )
    assert mirror_lines(read_entries(directory), "bookworm") == [
        "deb http://other.example/debian bookworm main",
        "deb http://old.example/debian bookworm-updates main",
        "deb http://mirror.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]


def test_another_suite_or_no_sources_gives_nothing_so_mmdebstrap_uses_its_default(tmp_path: Path) -> None:
    directory = apt_dir(tmp_path, {"sources.list.d/debian.sources": DEB822})
    assert mirror_lines(read_entries(directory), "bullseye") == []
    assert mirror_lines(read_entries(tmp_path / "missing"), "bookworm") == []


def test_the_command_prints_one_line_per_mirror(tmp_path: Path) -> None:
    directory = apt_dir(tmp_path, {"sources.list.d/debian.sources": DEB822})
    proc = subprocess.run(
        [sys.executable, "-m", "tools.image.sources", "bookworm", str(directory)],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert proc.stdout.splitlines() == [
        "deb http://mirror.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]


def test_a_suite_that_is_not_a_release_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bookworm main"])
    assert exc.value.code == 2
    assert "suite must be a Debian release name like bookworm, got 'bookworm main'" in capsys.readouterr().err
