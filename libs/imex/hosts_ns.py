"""A daemon's private /etc/hosts: its own mount namespace, and how to look inside it.

nvidia-imex resolves the names of its nodes config with the system resolver, which reads
/etc/hosts; so does nvidia-imex-ctl for ``-N``. The IMEX agent gives each daemon a mount namespace
of its own with the domain's hosts file bind-mounted over /etc/hosts: the node's /etc/hosts is
untouched, and the slot names resolve only in there. Every ctl call must therefore run in the
daemon's mount namespace too. The simulated daemon is started the same way, so that a ctl run
anywhere else fails as it would on a real node.

* `private_hosts_argv`: the command line that runs a program in a new mount namespace with a
  hosts file over /etc/hosts (util-linux ``unshare`` and ``mount``);
* `enter_private_hosts`: the same for the calling process (the simulator's fork server calls it
  in each child before it becomes a daemon);
* `in_namespace_argv`: the command line that runs a program in another process's mount
  namespace (``nsenter``), and in its user namespace when it has one of its own;
* `namespace_root`: a path through which this process reads files as that process's mount
  namespace shows them (``/proc/<pid>/root``, proc(5)).

A new mount namespace needs CAP_SYS_ADMIN (the IMEX agent's container is privileged). Without
it, `enter_private_hosts` creates a user namespace mapping only the caller's own ids, which an
unprivileged developer may do where the kernel allows unprivileged user namespaces.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence

ETC_HOSTS = "/etc/hosts"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

_libc: ctypes.CDLL | None = None


class NamespaceError(OSError):
    """A private mount namespace could not be set up."""


def private_hosts_argv(argv: Sequence[str], hosts: str) -> list[str]:
    """`argv` run in a mount namespace of its own in which `hosts` is bind-mounted over
    /etc/hosts. The program is exec'd in place of the wrapper: its pid is the one started."""
    script = f'mount --bind "$1" {ETC_HOSTS} && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script,
            "hosts-mount", hosts, *argv]  # fmt: skip


def in_namespace_argv(pid: int, argv: Sequence[str]) -> list[str]:
    """`argv` run in the mount namespace of process `pid` (and in its user namespace when that
    is not ours: a namespace an unprivileged agent created can only be entered that way)."""
    user = ["--user", "--preserve-credentials"] if not _same_namespace(pid, "user") else []
    return ["nsenter", "--mount", *user, "--target", str(pid), "--", *argv]


def namespace_root(pid: int) -> str:
    """The root directory of process `pid`, through which paths resolve in its mount namespace."""
    return f"/proc/{pid}/root"


def enter_private_hosts(hosts: str) -> None:
    """Move the calling (single-threaded) process into a mount namespace of its own, with
    `hosts` bind-mounted over /etc/hosts. NamespaceError if that cannot be done."""
    libc = load_libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        first = ctypes.get_errno()
        if first != errno.EPERM:
            raise NamespaceError(first, f"unshare(CLONE_NEWNS): {os.strerror(first)}")
        _enter_own_user_namespace(libc)
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        _raise("making the mount tree private")
    if libc.mount(os.fsencode(hosts), os.fsencode(ETC_HOSTS), None, _MS_BIND, None) != 0:
        _raise(f"bind-mounting {hosts} over {ETC_HOSTS}")


def _enter_own_user_namespace(libc: ctypes.CDLL) -> None:
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
        _raise("unshare(CLONE_NEWUSER | CLONE_NEWNS) without CAP_SYS_ADMIN")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
            f.write(text)


def load_libc() -> ctypes.CDLL:
    """libc through ctypes (loaded once per process)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _raise(what: str) -> None:
    code = ctypes.get_errno()
    raise NamespaceError(code, f"{what}: {os.strerror(code)}")


def _same_namespace(pid: int, kind: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return True  # gone or hidden: nsenter will say what is wrong
