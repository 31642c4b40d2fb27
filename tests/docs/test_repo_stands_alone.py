"""The repo's words stand alone: nothing it ships points at a design document users do not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Citations of the project's private design notes (by section sign, file name or sibling folder),
# which a clone lacks.
_OUTSIDE_REFERENCE = re.compile(r"\bSPEC\s*§|\bSPEC\.md\b|\.\./shared\b")


def test_no_tracked_file_cites_the_private_design_notes() -> None:
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    offenders = []
    for name in filter(None, files):
        path = REPO / name
        if not path.is_file() or path.suffix in {".png", ".jpg", ".gz"}:
            continue
        text = path.read_text(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE_REFERENCE.search(line):
                offenders.append(f"{name}:{lineno}: {line.strip()[:100]}")
    assert not offenders, "references to documents outside the repo:\n" + "\n".join(offenders)
