"""Async client of the simulated daemon's command service (the in-process form of the ctl tool).

The IMEX agent polls its daemons with these calls instead of spawning a ctl process per poll, and
simulated jobs import memory through them. Every call opens one short TCP connection to one
daemon and is bounded by its ``timeout`` (seconds); a daemon that is not running, refuses, hangs
or answers garbage raises ``DaemonUnavailable`` (``query_state``/``query_ready`` answer
UNAVAILABLE/False instead). A command the daemon declines raises ``CommandRejected``.

* ``query_status(host, port, timeout)`` -> ``DaemonStatus`` (``.ready``, ``.node_id``,
  ``.instance``, ``.nodes``, ``.addresses``/``.connections``/``.reasons`` keyed by node ID)
* ``import_memory(host, port, job, node_id, timeout)`` -> the exporter's instance
* ``list_imports(host, port, timeout)`` -> ``list[Import]``
* ``unimport(host, port, job, timeout)`` -> how many imports were dropped
* ``inject_fault(host, port, fault, peer=None, timeout)``
"""

from __future__ import annotations

import asyncio
import socket

from libs.imex import config as keys
from libs.imex.config import parse_imex_config, parse_nodes_config
from tools.sim.imex import protocol as proto
from tools.sim.imex.domain_status import DaemonStatus, Import

__all__ = [
    "CommandEndpointError",
    "CommandRejected",
    "DaemonStatus",
    "DaemonUnavailable",
    "Import",
    "command_endpoint",
    "import_memory",
    "inject_fault",
    "list_imports",
    "query_ready",
    "query_state",
    "query_status",
    "read_config",
    "read_nodes",
    "request",
    "unimport",
]

DEFAULT_TIMEOUT_S = 2.0
FAULTS = ("crash", "hang", "drop-peer", "heal")  # what the ctl tool injects
CUT_LINKS = "cut-links"  # cdsim's partition fault (takes a duration)
_MAX_REPLY = 1 << 20
_RECV_CHUNK = 1 << 16


class DaemonUnavailable(Exception):
    """The daemon's command service could not be reached or gave no usable answer."""


class CommandRejected(Exception):
    """The daemon answered ERR to a command."""


class CommandEndpointError(Exception):
    """config.cfg does not let a client reach the command service."""


def command_endpoint(config: dict[str, str]) -> tuple[str, int]:
    """Return (host, port) of the command service described by parsed config.cfg values.

    As nvidia-imex-ctl does: needs ``IMEX_CMD_ENABLED=1``; an empty
    ``IMEX_CMD_BIND_INTERFACE_IP`` means the daemon listens on every interface, so 127.0.0.1.
    """
    if config.get(keys.IMEX_CMD_ENABLED, "0") != "1":
        raise CommandEndpointError("the command service is not enabled in the config (IMEX_CMD_ENABLED=1)")
    host = config.get(keys.IMEX_CMD_BIND_INTERFACE_IP, "") or "127.0.0.1"
    raw_port = config.get(keys.IMEX_CMD_PORT, "") or str(keys.DEFAULT_CMD_PORT)
    try:
        return host, int(raw_port)
    except ValueError:
        raise CommandEndpointError(f"IMEX_CMD_PORT is not a port number: {raw_port!r}") from None


def read_config(config_path: str) -> dict[str, str]:
    """Read and parse config.cfg (OSError if it cannot be read)."""
    with open(config_path, encoding="utf-8") as f:
        return parse_imex_config(f.read())


def read_nodes(config: dict[str, str]) -> list[str]:
    """The entries of the nodes config named by parsed config.cfg values (OSError if unreadable)."""
    path = config.get(keys.IMEX_NODE_CONFIG_FILE) or keys.DEFAULT_NODES_CONFIG_FILE
    with open(path, encoding="utf-8") as f:
        return parse_nodes_config(f.read())


async def request(
    host: str,
    port: int,
    message: bytes,
    timeout: float,  # noqa: ASYNC109
) -> tuple[str, dict[str, str]]:
    """Send one command line and return the decoded reply (verb, fields).

    Raises DaemonUnavailable on connection failure, timeout, or an empty/garbled reply.
    """
    # Plain non-blocking socket calls, not asyncio streams: an IMEX agent probes its daemon
    # every few tenths of a second while it starts, and a stream's transport, protocol and
    # closing handshake cost several times this exchange (profiles of the 256-node formation).
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    reply = b""
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, message)
            while not reply.endswith(b"\n"):
                more = await loop.sock_recv(sock, _RECV_CHUNK)
                if not more:
                    break
                reply += more
                if len(reply) > _MAX_REPLY:
                    raise DaemonUnavailable(f"{host}:{port} replied more than {_MAX_REPLY} bytes")
    except TimeoutError:
        raise DaemonUnavailable(f"no reply from {host}:{port} within {timeout:g} s") from None
    except OSError as exc:
        raise DaemonUnavailable(f"cannot reach {host}:{port}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    if not reply:
        raise DaemonUnavailable(f"{host}:{port} closed the connection without a reply")
    try:
        return proto.decode(reply)
    except ValueError as exc:
        raise DaemonUnavailable(f"garbled reply from {host}:{port}: {exc}") from None


async def query_status(
    cmd_host: str,
    cmd_port: int,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
) -> DaemonStatus:
    """The daemon's own status: state, node ID, instance, and its link to every node ID."""
    verb, fields = await request(cmd_host, cmd_port, proto.encode(proto.CMD_STATUS), timeout)
    if verb != proto.CMD_STATUS:
        raise DaemonUnavailable(f"unexpected reply {verb} to STATUS from {cmd_host}:{cmd_port}")
    try:
        return DaemonStatus.from_fields(fields)
    except ValueError as exc:
        raise DaemonUnavailable(str(exc)) from None


async def query_state(
    cmd_host: str,
    cmd_port: int,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
) -> str:
    """The word ``nvidia-imex-ctl -q`` prints: the daemon's state, or UNAVAILABLE."""
    try:
        return (await query_status(cmd_host, cmd_port, timeout)).state
    except DaemonUnavailable:
        return proto.STATE_UNAVAILABLE


async def query_ready(
    cmd_host: str,
    cmd_port: int,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
) -> bool:
    """True when the daemon answers and is READY; False otherwise (never raises for I/O)."""
    return await query_state(cmd_host, cmd_port, timeout) == proto.STATE_READY


def _timeout(timeout: float, timeout_s: float | None) -> float:
    return timeout if timeout_s is None else timeout_s


async def import_memory(
    cmd_host: str,
    cmd_port: int,
    job: str,
    node_id: int,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
    *,
    timeout_s: float | None = None,
) -> str:
    """Record that local ``job`` imported memory exported by node ``node_id``'s daemon.

    Works only while the daemon's link to that node is CONNECTED; returns the exporter's
    instance. Raises CommandRejected otherwise, DaemonUnavailable if the daemon cannot be asked.
    (``timeout_s`` is an alias of ``timeout``.)
    """
    message = proto.encode(proto.CMD_IMPORT, {"job": job, "node": str(node_id)})
    verb, fields = await request(cmd_host, cmd_port, message, _timeout(timeout, timeout_s))
    if verb != proto.REPLY_OK:
        raise CommandRejected(fields.get("reason", verb))
    return fields.get("instance", "")


async def list_imports(
    cmd_host: str,
    cmd_port: int,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
    *,
    timeout_s: float | None = None,
) -> list[Import]:
    """Every import of the daemon's local jobs, valid or not (invalid ones say why)."""
    verb, fields = await request(
        cmd_host, cmd_port, proto.encode(proto.CMD_IMPORTS), _timeout(timeout, timeout_s)
    )
    if verb != proto.CMD_IMPORTS:
        raise DaemonUnavailable(f"unexpected reply {verb} to IMPORTS from {cmd_host}:{cmd_port}")
    try:
        return Import.list_from_fields(fields)
    except ValueError as exc:
        raise DaemonUnavailable(str(exc)) from None


async def unimport(
    cmd_host: str,
    cmd_port: int,
    job: str,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
    *,
    timeout_s: float | None = None,
) -> int:
    """Drop every import of ``job`` (the job ended); returns how many there were."""
    message = proto.encode(proto.CMD_UNIMPORT, {"job": job})
    verb, fields = await request(cmd_host, cmd_port, message, _timeout(timeout, timeout_s))
    if verb != proto.REPLY_OK:
        raise CommandRejected(fields.get("reason", verb))
    removed = fields.get("removed", "0")
    return int(removed) if removed.isdigit() else 0


async def inject_fault(
    cmd_host: str,
    cmd_port: int,
    fault: str,
    peer: str | int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109
    *,
    seconds: float | None = None,
) -> None:
    """Inject a fault: ``crash``, ``hang``, ``drop-peer`` (needs ``peer``), ``heal`` or
    ``cut-links`` (needs ``seconds``: every peer link of the daemon partitioned that long).

    ``peer`` of drop-peer is a node ID (an int or a string of digits) or a peer's address.

    Raises ValueError for an unknown fault, DaemonUnavailable if the daemon cannot be told, and
    CommandRejected if it refuses.
    """
    if fault == "crash":
        message = proto.encode(proto.CMD_CRASH)
    elif fault == "hang":
        message = proto.encode(proto.CMD_HANG)
    elif fault == "heal":
        message = proto.encode(proto.CMD_HEAL)
    elif fault == "drop-peer":
        if peer is None or peer == "":
            raise ValueError("drop-peer needs the peer's node ID or address")
        key = "node" if isinstance(peer, int) or peer.isdigit() else "addr"
        message = proto.encode(proto.CMD_DROP, {key: str(peer)})
    elif fault == CUT_LINKS:
        if seconds is None or not 0 < seconds <= 3600:
            raise ValueError(f"cut-links needs seconds in (0, 3600], got {seconds}")
        message = proto.encode(proto.CMD_CUT, {"seconds": repr(float(seconds))})
    else:
        raise ValueError(f"unknown fault {fault!r}; expected one of {(*FAULTS, CUT_LINKS)}")
    verb, fields = await request(cmd_host, cmd_port, message, timeout)
    if verb != proto.REPLY_OK:
        raise CommandRejected(fields.get("reason", verb))
