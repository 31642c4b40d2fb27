"""nvidia-imex resolves the slot names through the domain's hosts file, in a mount namespace of its own.

The real daemon uses the system resolver, so it is started with the domain's `hosts` bind-mounted
over /etc/hosts (`ExecLauncher`, the IMEX daemon port's nvidia-imex side). A stand-in for
nvidia-imex, started exactly that way, resolves a slot name with getent (libc, as nvidia-imex
would) over and over: it must see the slot's address, see a rewrite made in place, and leave this
machine's /etc/hosts alone.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.imex import slots
from libs.imex.nvidia_imex import ExecLauncher
from services.imexagent.domain_dir import DomainDir
from tests.polling import wait_until

UID = "0f0e0d0c-1111-2222-3333-444455556666"
CLIQUE = "cluster.7"
NAME = slots.slot_name(UID, CLIQUE, 3)

STAND_IN = """#!/bin/sh
# A stand-in for nvidia-imex: resolve slot 3 every 20 ms, as a reconnect loop would; write the
# address and how many lookups were made so far.
out="$(dirname "$2")/resolved"
n=0
while :; do
  n=$((n + 1))
  echo "$(getent hosts {name} | cut -d' ' -f1) $n" > "$out.tmp"; mv "$out.tmp" "$out"
  sleep 0.02
done
"""


def addresses(slot3: str) -> list[str]:
    return [slots.PLACEHOLDER_ADDRESS] * 3 + [slot3] + [slots.PLACEHOLDER_ADDRESS] * 14


def lookup(directory: DomainDir) -> tuple[str, int]:
    """The stand-in's last lookup: (address, number of lookups so far)."""
    fields = (directory.read(directory.path / "resolved") or "").split()
    return (fields[0], int(fields[1])) if len(fields) == 2 else ("", 0)


def resolved(directory: DomainDir, want: str, timeout_s: float = 10.0) -> str:
    """The address the stand-in resolves, once it is `want`."""
    return wait_until(
        lambda: want if lookup(directory)[0] == want else None,
        f"the stand-in daemon to resolve {want}",
        timeout_s,
        explain=lambda: f"last lookup: {lookup(directory)}",
        first_delay_s=0.02,
        max_delay_s=0.1,
    )


def after_lookups(directory: DomainDir, more: int, timeout_s: float = 10.0) -> str:
    """The address the stand-in resolves once it has looked up `more` more times."""
    _, start = lookup(directory)

    def resolved_again() -> str | None:
        seen, count = lookup(directory)
        return seen if count >= start + more else None

    return wait_until(
        resolved_again,
        f"the stand-in daemon to look up {more} more times",
        timeout_s,
        first_delay_s=0.02,
        max_delay_s=0.1,
    )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DomainDir]:
    if shutil.which("unshare") is None or shutil.which("getent") is None:
        pytest.fail(
            "unshare (util-linux) and getent (libc-bin) are needed: both are in every Debian base system"
        )
    directory = DomainDir(tmp_path / UID)
    directory.path.mkdir()
    directory.config.write_text("")
    directory.write_hosts(slots.render_hosts(addresses("127.40.0.4"), UID, CLIQUE))
    binary = tmp_path / "nvidia-imex"
    binary.write_text(STAND_IN.format(name=NAME))
    binary.chmod(0o755)
    launcher = ExecLauncher([str(binary)])
    argv = launcher.argv(directory.config, directory.hosts)
    process = launcher.spawn(argv, directory.path, directory.path / "nvidia-imex.log", directory.hosts)
    try:
        yield directory
    finally:
        process.kill()
        process.wait(10)


def test_the_daemon_resolves_its_slots_through_the_domains_hosts_file(daemon: DomainDir) -> None:
    host_hosts = Path("/etc/hosts").read_text()
    assert resolved(daemon, "127.40.0.4") == "127.40.0.4"
    assert NAME not in host_hosts and Path("/etc/hosts").read_text() == host_hosts


def test_a_rewrite_in_place_reaches_the_running_daemon(daemon: DomainDir) -> None:
    assert resolved(daemon, "127.40.0.4") == "127.40.0.4"
    daemon.write_hosts(slots.render_hosts(addresses("127.40.0.9"), UID, CLIQUE), in_place=True)
    assert resolved(daemon, "127.40.0.9") == "127.40.0.9"


def test_a_renamed_file_would_not_reach_it(daemon: DomainDir) -> None:
    """Why the IMEX agent rewrites in place for nvidia-imex: the bind mount pins the inode."""
    assert resolved(daemon, "127.40.0.4") == "127.40.0.4"
    daemon.write_hosts(slots.render_hosts(addresses("127.40.0.9"), UID, CLIQUE), in_place=False)
    assert after_lookups(daemon, more=10) == "127.40.0.4"
