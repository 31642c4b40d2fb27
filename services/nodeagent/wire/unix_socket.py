"""gRPC (grpclib) servers on unix sockets the way kubelet plugins need them.

The socket is bound with a restrictive umask and then set to ``mode`` (default 0660), so it is
never world-writable, not even for the moment between bind and chmod. A socket file left by a
previous run is removed; one that still has a live server behind it is not stolen.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

import structlog
from grpclib.server import Server

from libs.runtime.errors import PermanentError
from libs.runtime.grpc_limits import LimitedServer, ServerLimits

log = structlog.get_logger(__name__)

SOCKET_MODE = 0o660
DIR_MODE = 0o750
# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class SocketInUse(PermanentError, RuntimeError):
    """Another live server listens on the socket path."""


def _is_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def bind_unix_socket(path: Path, mode: int = SOCKET_MODE) -> socket.socket:
    """A listening-ready unix stream socket at ``path`` with permissions ``mode``."""
    if mode & 0o002:
        raise ValueError(f"refusing a world-writable socket mode {mode:o} for {path}")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"unix socket path too long ({len(os.fsencode(path))} > {MAX_SOCKET_PATH} bytes): {path}"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ValueError(f"{path} exists and is not a socket; not removing it")
        if _is_live(path):
            raise SocketInUse(f"another process is serving {path}")
        path.unlink()
        log.info("removed stale socket", path=str(path))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.setblocking(False)
    return sock


# Kubelet holds its connection to a plugin open between calls: no idle timeout, no connection cap
# (the socket's mode admits kubelet's group only); the message size is bounded.
KUBELET_SOCKET_LIMITS = ServerLimits(idle_timeout_s=None, max_connections=None)


async def start_unix_server(
    handlers: Sequence[object],
    path: Path,
    mode: int = SOCKET_MODE,
    limits: ServerLimits = KUBELET_SOCKET_LIMITS,
) -> Server:
    """A started grpclib server for ``handlers`` on the unix socket ``path``."""
    server = LimitedServer(list(handlers), limits=limits)
    sock = bind_unix_socket(path, mode)
    try:
        await server.start(sock=sock)
    except BaseException:
        sock.close()
        raise
    log.info("grpc server listening", path=str(path), mode=f"{mode:o}")
    return server


async def stop_unix_server(server: Server, path: Path, grace_s: float = 5.0) -> None:
    """Stop accepting, let running calls finish within ``grace_s``, remove the socket file."""
    server.close()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.wait_closed(), grace_s)
    _remove_socket(path)


def _remove_socket(path: Path) -> None:
    try:
        path.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot remove socket", path=str(path), error=str(exc))
