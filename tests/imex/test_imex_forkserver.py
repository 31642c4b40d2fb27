"""The simulator's fork server starts daemons that are what exec'd ones are: own process and
session, the daemon's command line, output in their log, exit status known, surviving the server."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.invariants.processes import IMEX_DAEMON_MARKER, imex_daemons_under
from services.imexagent.process import leftover_pids, proc_cmdline
from tests.imex.simdomain import SimCluster
from tests.polling import wait_until
from tools.launch import pid_alive
from tools.sim.imex.launch import ForkServer, ForkServerError, simulator_daemon_argv


def _gone(pid: int) -> bool:
    """Exited: no longer in /proc, or a zombie waiting to be reaped by the server."""
    return not pid_alive(pid)


def _wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    wait_until(lambda: _gone(pid), f"process {pid} to exit", timeout_s, first_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fs = ForkServer()
    yield fs
    fs.close()


async def test_forked_daemon_is_a_daemon_process(cluster: SimCluster, server: ForkServer) -> None:
    (node,) = cluster.domain(1)
    argv = simulator_daemon_argv(str(node.config_path))
    child = server.spawn(argv, node.directory, node.directory / "out.log")
    try:
        await node.wait_until(lambda st: st.ready, "READY")
        assert proc_cmdline(child.pid) == argv  # what ps, process scans and adoption see
        assert os.getsid(child.pid) == child.pid  # its own session: outlives its agent
        assert os.readlink(f"/proc/{child.pid}/cwd") == str(node.directory)
        assert child.pid in leftover_pids(node.directory, node.config_path)
        assert [p.pid for p in imex_daemons_under(node.directory)] == [child.pid]
        assert IMEX_DAEMON_MARKER in " ".join(proc_cmdline(child.pid))
        assert f"pid {child.pid}" in node.log_text()  # the daemon's own log names its pid
        os.kill(child.pid, signal.SIGTERM)
        _wait_gone(child.pid)
        assert child.wait() == 0  # a clean SIGTERM exit
    finally:
        if child.returncode is None:
            os.kill(child.pid, signal.SIGKILL)


async def test_exit_status_and_output_of_a_failing_daemon(cluster: SimCluster, server: ForkServer) -> None:
    node = cluster.node("127.77.250.1")
    node.write_config(["127.77.250.2"])  # no slot resolves to its own address
    out = node.directory / "out.log"
    child = server.spawn(simulator_daemon_argv(str(node.config_path)), node.directory, out)
    _wait_gone(child.pid)
    assert child.wait() == 1
    assert "ERROR" in node.log_text()

    missing = node.directory / "missing.cfg"
    child = server.spawn(simulator_daemon_argv(str(missing)), node.directory, out)
    _wait_gone(child.pid)
    assert child.wait() == 1
    assert f"imex-sim: [Errno 2] No such file or directory: '{missing}'" in out.read_text()  # stderr


async def test_daemons_outlive_the_server_and_a_dead_server_is_replaced(
    cluster: SimCluster, server: ForkServer
) -> None:
    first, second = cluster.domain(2)
    a = server.spawn(simulator_daemon_argv(str(first.config_path)), first.directory, first.directory / "o")
    server.close()  # the agent is gone: the server exits, the daemon runs on
    try:
        status = await first.wait_until(lambda st: st.ready, "READY")
        assert status.pid == a.pid
        b = server.spawn(
            simulator_daemon_argv(str(second.config_path)), second.directory, second.directory / "o"
        )
        assert b.pid != a.pid
        await first.wait_connected([1])
        await second.wait_connected([0])
    finally:
        for pid in (a.pid, locals().get("b", a).pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_bad_requests_name_the_problem(tmp_path: Path, server: ForkServer) -> None:
    with pytest.raises(ValueError, match="not a simulated daemon command line"):
        server.spawn(["/bin/true", "-c", "x"], tmp_path, tmp_path / "o")
    config = str(tmp_path / "c.cfg")
    with pytest.raises(ForkServerError, match=f"working directory {tmp_path / 'nope'} does not exist"):
        server.spawn(simulator_daemon_argv(config), tmp_path / "nope", tmp_path / "o")
    too_long = simulator_daemon_argv(str(tmp_path / ("d" * 5000) / "c.cfg"))
    child = server.spawn(too_long, tmp_path, tmp_path / "o")  # starts, but cannot take that title
    _wait_gone(child.pid)
    assert child.wait() == 1
    assert "does not fit the room" in (tmp_path / "o").read_text()
