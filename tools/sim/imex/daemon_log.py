"""The simulated daemon's log, shaped like nvidia-imex's (pure standard library, cheap to import)."""

from __future__ import annotations

import os
import sys
import time


class DaemonLog:
    """Log lines shaped like nvidia-imex's (``[date] [LEVEL] [tid N] message``).

    Written to LOG_FILE_NAME (stderr when empty or not writable), filtered by LOG_LEVEL, rotated
    at LOG_FILE_MAX_SIZE into ``<name>.1`` .. ``<name>.<LOG_MAX_ROTATE_COUNT>``.
    """

    LEVELS = {"CRITICAL": 1, "ERROR": 2, "WARNING": 3, "INFO": 4}

    def __init__(self, path: str, level: int, append: bool, max_bytes: int, rotate_count: int) -> None:
        self.path = path
        self.level = level
        self.max_bytes = max_bytes
        self.rotate_count = rotate_count
        self.tid = os.getpid()
        self.size = 0
        self.stopped = False
        self.file = sys.stderr
        self.open_error = ""
        if path:
            try:
                self.file = open(path, "a" if append else "w", buffering=1, encoding="utf-8")
                self.size = self.file.tell()
            except OSError as exc:
                self.open_error = f"cannot open log file {path}: {exc.strerror}; logging to stderr"
                self.path = ""

    def write(self, level: str, message: str) -> None:
        if self.stopped or self.LEVELS.get(level, 4) > self.level:
            return
        now = time.time()
        stamp = time.strftime("%b %d %Y %H:%M:%S", time.localtime(now))
        line = f"[{stamp}.{int(now * 1000) % 1000:03d}] [{level}] [tid {self.tid}] {message}\n"
        try:
            self.file.write(line)
        except (OSError, ValueError):
            return
        if self.path:
            self.size += len(line)
            if self.size >= self.max_bytes:
                self._rotate()

    def _rotate(self) -> None:
        self.file.close()
        if self.rotate_count <= 0:
            self.stopped = True  # nvidia-imex stops logging when rotation is disabled
            return
        for index in range(self.rotate_count - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        os.replace(self.path, f"{self.path}.1")
        self.file = open(self.path, "w", buffering=1, encoding="utf-8")
        self.size = 0

    def close(self) -> None:
        if self.file is not sys.stderr:
            self.file.close()
