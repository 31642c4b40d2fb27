"""Crash-safe file replacement and removal.

A reader (kubelet, a container runtime, our own agent after a restart) must only ever see the old
content or the new content of a file, never a prefix of it. So content goes to a temp file in the
same directory (same filesystem, so the rename is atomic), is fsynced, then renamed over the final
name, and the directory is fsynced so the rename itself survives a power loss.

Temp files are named ``.<final name>.<random>.tmp``: hidden and ending in ``.tmp``, so a directory
scanner that looks for ``*.json`` / ``*.yaml`` (the CDI loader does) never mistakes one for a real
file, and :func:`remove_stale_temps` can find the litter a crash left behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def _temp_prefix(final_name: str) -> str:
    return f".{final_name}."


def fsync_dir(directory: Path) -> None:
    """Make entries created, renamed or removed in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and (with ``durable``) durably.

    The file gets exactly ``mode`` (the umask does not apply). On any error the temp file is
    removed and the previous content of ``path``, if any, is left untouched. Without ``durable``
    nothing is fsynced: readers see the old or the new content, also after the writer is killed,
    but what a power loss leaves is not defined (for state that lives one boot only).
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=_temp_prefix(path.name), suffix=TEMP_SUFFIX)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if durable:
        fsync_dir(directory)


def remove_durable(path: Path) -> bool:
    """Remove ``path`` and fsync its directory. Returns False if it did not exist."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def is_temp_name(name: str) -> bool:
    """True for names :func:`write_atomic` uses for its temp files."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def remove_stale_temps(directory: Path, final_name_prefix: str = "") -> list[Path]:
    """Remove temp files left by a crash inside :func:`write_atomic`.

    Only temp files whose final name starts with ``final_name_prefix`` are touched, so callers
    sharing a directory clean up only their own litter. Call it at start-up, before any writer
    runs in that directory. Returns the removed paths.
    """
    removed: list[Path] = []
    prefix = "." + final_name_prefix
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(prefix) and is_temp_name(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
                removed.append(directory / name)
    if removed:
        fsync_dir(directory)
    return removed
