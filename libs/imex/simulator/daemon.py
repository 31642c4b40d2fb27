"""Simulated nvidia-imex daemon: ``python -m libs.imex.simulator.daemon -c <config.cfg>``.

It reads the same ``config.cfg`` and nodes config as nvidia-imex, listens on
``BIND_INTERFACE_IP:SERVER_PORT``, dials every other listed node over TCP with a handshake that
carries the domain identity (``# SIM_DOMAIN_ID``; a peer of another domain is refused and the
refusal logged, the guard against address reuse across domains, upstream #1447), keeps links
alive with heartbeats, reconnects with capped backoff, and serves a command service on
``IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT`` for the ctl tool (status and fault injection).

State (``nvidia-imex-ctl -q``): ``WAITING_FOR_PEERS`` until its outgoing link to every listed
peer is up, then ``READY``; with ``IMEX_WAIT_FOR_QUORUM=NONE`` it is ``READY`` as soon as it
listens. (The real daemon only waits for recovery quorum after an unclean stop; the simulator
waits for all peers because a ComputeDomain is only usable once its members are connected.)
Incoming links from a same-domain node that is not (yet) in this node's list are accepted, so a
joining node does not wait for the older members to be reconfigured.

Signals: SIGUSR1 re-reads the nodes config and reconnects (removed peers dropped, new ones
dialled, drop-peer faults healed) without restarting; optionally rate-limited like nvidia-imex
(``# SIM_SIGUSR1_MIN_INTERVAL_S``, nvidia-imex ignores repeats within 5 s). SIGTERM, SIGINT and
SIGQUIT: tell peers (BYE), close, exit 0. SIGHUP is logged and otherwise ignored.

Faults (through the command service): ``CRASH`` exits 1 at once; ``HANG`` blocks the process
for good (no replies, heartbeats or signal handling; only SIGKILL ends it); ``DROP addr`` cuts
that peer and refuses it until SIGUSR1 or ``HEAL``.

Start-up time is a product target (many daemons start at once on small machines), so this
module uses epoll and the C-level ``_socket``/``_signal`` modules directly: importing asyncio,
socket (enum), json or random would cost several times the rest of start-up.
"""

from __future__ import annotations

import _signal
import _socket
import errno
import os
import select
import sys
import time

from libs.imex import config as keys
from libs.imex.config import parse_imex_config, parse_nodes_config
from libs.imex.simulator import protocol as proto

EXIT_OK = 0
EXIT_ERROR = 1  # bad configuration, bind failure, injected crash

DEFAULT_LOG_FILE = "/var/log/nvidia-imex.log"
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
DEFAULT_RECONNECT_MAX_S = 1.0
RECONNECT_INITIAL_S = 0.02
HEARTBEAT_TIMEOUT_FACTOR = 3.0  # a link silent for this many heartbeat intervals is dead
LISTEN_BACKLOG = 128
REFUSAL_LOG_EVERY = 50  # a repeated refusal is logged once, then every Nth time

_PING_LINE = proto.encode(proto.PING).rstrip(b"\n")
_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_EPOLL_BROKEN = select.EPOLLERR | select.EPOLLHUP

_SHUTDOWN_SIGNALS = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGQUIT)
_SIGNAL_NAMES = {
    _signal.SIGTERM: "SIGTERM",
    _signal.SIGINT: "SIGINT",
    _signal.SIGQUIT: "SIGQUIT",
    _signal.SIGUSR1: "SIGUSR1",
    _signal.SIGHUP: "SIGHUP",
}

# Link phases.
_CONNECTING = "connecting"  # TCP connect in progress (outgoing only)
_HANDSHAKE = "handshake"  # waiting for HELLO (incoming) or WELCOME/REFUSE (outgoing)
_OPEN = "open"
# Connection kinds.
_OUT = "out"
_IN = "in"
_CMD = "cmd"


class ConfigError(Exception):
    """The configuration cannot be used; the daemon exits with EXIT_ERROR."""


class Settings:
    """The values the simulator uses from config.cfg, with nvidia-imex's defaults."""

    def __init__(self, values: dict[str, str], config_path: str) -> None:
        self.config_path = config_path
        self.values = values
        self.bind_ip = values.get(keys.BIND_INTERFACE_IP, "")
        if not self.bind_ip:
            raise ConfigError(
                "BIND_INTERFACE_IP is empty: the simulator cannot pick this node's address from the "
                "nodes config (every simulated address is local), set it explicitly"
            )
        self.server_port = _int(values, keys.SERVER_PORT, keys.DEFAULT_SERVER_PORT)
        self.nodes_config_file = values.get(keys.IMEX_NODE_CONFIG_FILE) or keys.DEFAULT_NODES_CONFIG_FILE
        self.wait_for_quorum = (
            values.get(keys.IMEX_WAIT_FOR_QUORUM, keys.QUORUM_RECOVERY) or keys.QUORUM_RECOVERY
        )
        self.cmd_enabled = values.get(keys.IMEX_CMD_ENABLED, "0") == "1"
        self.cmd_ip = values.get(keys.IMEX_CMD_BIND_INTERFACE_IP, "") or "0.0.0.0"
        self.cmd_port = _int(values, keys.IMEX_CMD_PORT, keys.DEFAULT_CMD_PORT)
        self.log_file = values.get(keys.LOG_FILE_NAME, DEFAULT_LOG_FILE)
        self.log_level = _int(values, keys.LOG_LEVEL, 4)
        self.log_append = values.get(keys.LOG_APPEND_TO_LOG, "1") != "0"
        self.log_max_bytes = _int(values, keys.LOG_FILE_MAX_SIZE, 1024) * 1024 * 1024
        self.log_rotate_count = _int(values, keys.LOG_MAX_ROTATE_COUNT, 3)
        self.daemonize = values.get(keys.DAEMONIZE, "1") == "1"
        self.domain_id = values.get(keys.SIM_DOMAIN_ID, "")
        self.node_name = values.get(keys.SIM_NODE_NAME, "")
        self.heartbeat_s = _seconds(values, keys.SIM_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_INTERVAL_S)
        if self.heartbeat_s <= 0:
            raise ConfigError(f"{keys.SIM_HEARTBEAT_INTERVAL_S} must be > 0")
        self.reconnect_max_s = _seconds(values, keys.SIM_RECONNECT_MAX_S, DEFAULT_RECONNECT_MAX_S)
        self.sigusr1_min_interval_s = _seconds(values, keys.SIM_SIGUSR1_MIN_INTERVAL_S, 0.0)


def _int(values: dict[str, str], key: str, default: int) -> int:
    raw = values.get(key, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key} must be an integer, got {raw!r}") from None


def _seconds(values: dict[str, str], key: str, default: float) -> float:
    raw = values.get(key, "")
    if raw == "":
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise ConfigError(f"{key} must be a number of seconds, got {raw!r}") from None
    if not seconds >= 0:
        raise ConfigError(f"{key} must be >= 0, got {raw!r}")
    return seconds


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


class Conn:
    """One TCP connection: a peer link (either direction) or a command-service client."""

    __slots__ = (
        "addr",
        "created",
        "fd",
        "kind",
        "last_recv",
        "last_sent",
        "phase",
        "rbuf",
        "sock",
        "wbuf",
        "writing",
    )

    def __init__(self, sock: _socket.socket, kind: str, phase: str, addr: str, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.kind = kind
        self.phase = phase
        self.addr = addr  # the peer's IMEX address (outgoing: known; incoming: after HELLO)
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.created = now
        self.last_recv = now
        self.last_sent = now
        self.writing = False  # registered for EPOLLOUT


class PeerLink:
    """This node's outgoing link to one listed peer, and what `-N` shows for it."""

    __slots__ = ("addr", "backoff", "conn", "ever_connected", "next_attempt", "reason", "refusals", "status")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.conn: Conn | None = None
        self.status = proto.CONN_NEVER_CONNECTED
        self.reason = ""
        self.backoff = RECONNECT_INITIAL_S
        self.next_attempt: float | None = None
        self.ever_connected = False
        self.refusals = 0


class Daemon:
    """The simulated daemon: listeners, peer links, command service, signals (one thread)."""

    def __init__(self, settings: Settings, log: DaemonLog) -> None:
        self.settings = settings
        self.log = log
        self.state = proto.STATE_INITIALIZING
        self.instance = f"{os.getpid()}.{time.time_ns()}"
        self.epoll = select.epoll()
        self.conns: dict[int, Conn] = {}
        self.nodes: list[str] = []  # the nodes config, in index order
        self.links: dict[str, PeerLink] = {}  # every listed node but this one
        self.incoming: dict[str, set[Conn]] = {}  # open incoming links by peer address
        self.dropped: set[str] = set()
        self.heard: dict[str, float] = {}  # peer address -> last message from it on any link
        self.refused_in: dict[tuple[str, str], int] = {}  # (address, code) -> times refused
        self.peer_listener: _socket.socket | None = None
        self.cmd_listener: _socket.socket | None = None
        self.wakeup_r = -1
        self.last_sigusr1 = -1e9
        self.next_tick = 0.0
        self.exit_code: int | None = None

    # ----------------------------------------------------------------- start-up and main loop

    def start(self, nodes: list[str]) -> None:
        """Bind the listeners and begin dialling peers. Raises OSError if a bind fails."""
        s = self.settings
        self._install_signal_handlers()
        self.peer_listener = self._listen(s.bind_ip, s.server_port, "peer service")
        if s.cmd_enabled:
            self.cmd_listener = self._listen(s.cmd_ip, s.cmd_port, "command service")
        self.state = proto.STATE_WAITING_FOR_PEERS
        self._apply_nodes(nodes, reason="start")
        self.next_tick = time.monotonic() + self._tick_interval()
        self._update_state()

    def run(self) -> int:
        while True:
            now = time.monotonic()
            timeout = self._next_deadline() - now
            events = self.epoll.poll(max(timeout, 0.0))
            for fd, mask in events:
                self._dispatch(fd, mask)
                if self.exit_code is not None:
                    return self.exit_code
            self._run_timers(time.monotonic())

    def _listen(self, ip: str, port: int, what: str) -> _socket.socket:
        sock = _socket.socket(_family(ip), _socket.SOCK_STREAM)
        try:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind((ip, port))
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"failed to bind the {what} to {ip}:{port}: {exc.strerror}") from None
        sock.setblocking(False)
        self.epoll.register(sock.fileno(), _EPOLLIN)
        self.log.write("INFO", f"Listening for the {what} on {ip}:{port}")
        return sock

    def _install_signal_handlers(self) -> None:
        # The C-level handler writes each signal number into this pipe, which wakes epoll; the
        # Python-level handler only has to exist (so the default action does not kill us).
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        _signal.set_wakeup_fd(wakeup_w)
        for signum in _SIGNAL_NAMES:
            _signal.signal(signum, _ignore_signal)
        self.epoll.register(self.wakeup_r, _EPOLLIN)

    def _tick_interval(self) -> float:
        return self.settings.heartbeat_s / 2

    def _next_deadline(self) -> float:
        deadline = self.next_tick
        for link in self.links.values():
            if link.next_attempt is not None and link.next_attempt < deadline:
                deadline = link.next_attempt
        return deadline

    def _dispatch(self, fd: int, mask: int) -> None:
        if self.peer_listener is not None and fd == self.peer_listener.fileno():
            self._accept(self.peer_listener, _IN)
        elif self.cmd_listener is not None and fd == self.cmd_listener.fileno():
            self._accept(self.cmd_listener, _CMD)
        elif fd == self.wakeup_r:
            self._handle_signals()
        else:
            conn = self.conns.get(fd)
            if conn is None:
                return
            if conn.phase == _CONNECTING:
                self._finish_connect(conn, broken=bool(mask & _EPOLL_BROKEN))
                return
            if mask & (_EPOLLIN | _EPOLL_BROKEN):
                self._read(conn)
            if mask & _EPOLLOUT and self.conns.get(fd) is conn:
                self._flush(conn)

    def _run_timers(self, now: float) -> None:
        for link in list(self.links.values()):
            if link.next_attempt is not None and link.next_attempt <= now:
                link.next_attempt = None
                self._dial(link)
        if now >= self.next_tick:
            self.next_tick = now + self._tick_interval()
            self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        # A peer is alive while any of its links to us carries messages. Each node pings over its
        # own outgoing link; over an incoming link only when it has no open outgoing link to that
        # peer. That is one ping per direction per pair instead of two.
        interval = self.settings.heartbeat_s
        dead_after = interval * HEARTBEAT_TIMEOUT_FACTOR
        for conn in list(self.conns.values()):
            if self.conns.get(conn.fd) is not conn:
                continue  # closed earlier in this pass
            heard = conn.last_recv
            if conn.phase == _OPEN and conn.kind != _CMD:
                heard = max(heard, self.heard.get(conn.addr, heard))
            if now - heard >= dead_after:
                what = "handshake" if conn.phase != _OPEN else "heartbeat"
                self._lost(conn, f"{what} timeout ({dead_after:g} s without a message)")
            elif (
                conn.phase == _OPEN
                and now - conn.last_sent >= interval
                and (conn.kind == _OUT or (conn.kind == _IN and not self._has_open_link(conn.addr)))
            ):
                self._send(conn, proto.encode(proto.PING))

    def _has_open_link(self, addr: str) -> bool:
        link = self.links.get(addr)
        return link is not None and link.conn is not None and link.conn.phase == _OPEN

    # ------------------------------------------------------------------------- connections

    def _accept(self, listener: _socket.socket, kind: str) -> None:
        while True:
            try:
                fd, _ = listener._accept()  # type: ignore[attr-defined]  # C-level accept: (fd, address)
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: try again on the next event
                self.log.write("ERROR", f"accept failed: {exc.strerror}")
                return
            sock = _socket.socket(listener.family, _socket.SOCK_STREAM, 0, fd)
            sock.setblocking(False)
            if kind == _IN:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            self._register(Conn(sock, kind, _HANDSHAKE, "", time.monotonic()), _EPOLLIN)

    def _register(self, conn: Conn, mask: int) -> None:
        self.conns[conn.fd] = conn
        self.epoll.register(conn.fd, mask)

    def _close(self, conn: Conn) -> None:
        if self.conns.pop(conn.fd, None) is None:
            return
        try:
            self.epoll.unregister(conn.fd)
        except OSError:
            pass
        conn.sock.close()
        if conn.kind == _IN and conn.addr:
            peers = self.incoming.get(conn.addr)
            if peers is not None:
                peers.discard(conn)
                if not peers:
                    del self.incoming[conn.addr]

    def _send(self, conn: Conn, data: bytes) -> None:
        conn.wbuf += data
        conn.last_sent = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.wbuf) if conn.wbuf else 0
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._lost(conn, f"send failed: {exc.strerror}")
            return
        del conn.wbuf[:sent]
        if conn.wbuf:
            if not conn.writing:
                conn.writing = True
                self.epoll.modify(conn.fd, _EPOLLIN | _EPOLLOUT)
        elif conn.kind == _CMD and conn.phase == _OPEN:
            self._close(conn)  # the command reply is out: one request per connection
        elif conn.writing:
            conn.writing = False
            self.epoll.modify(conn.fd, _EPOLLIN)

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(conn, f"connection error: {exc.strerror}")
            return
        if not data:
            self._lost(conn, "connection closed by peer")
            return
        conn.last_recv = time.monotonic()
        if conn.addr and conn.phase == _OPEN and conn.kind != _CMD:
            self.heard[conn.addr] = conn.last_recv
        conn.rbuf += data
        while self.conns.get(conn.fd) is conn:
            end = conn.rbuf.find(b"\n")
            if end < 0:
                if len(conn.rbuf) > proto.MAX_LINE:
                    self._lost(conn, "message too long")
                return
            line = bytes(conn.rbuf[:end])
            del conn.rbuf[: end + 1]
            if line == _PING_LINE:
                continue  # the common case; receiving it already counted as a sign of life
            try:
                verb, fields = proto.decode(line)
            except ValueError as exc:
                self._lost(conn, f"malformed message: {exc}")
                return
            if conn.kind == _OUT:
                self._on_outgoing_message(conn, verb, fields)
            elif conn.kind == _IN:
                self._on_incoming_message(conn, verb, fields)
            else:
                self._on_command(conn, verb, fields)

    def _lost(self, conn: Conn, reason: str) -> None:
        """A connection ended (closed, failed or timed out)."""
        self._close(conn)
        if conn.kind == _OUT:
            link = self.links.get(conn.addr)
            if link is not None and link.conn is conn:
                status = proto.CONN_DISCONNECTED if link.ever_connected else proto.CONN_NEVER_CONNECTED
                self._link_down(link, status, reason)
        elif conn.kind == _IN and conn.phase == _OPEN:
            self.log.write("INFO", f"Incoming connection from {conn.addr} ended: {reason}")

    # ------------------------------------------------------------------------ outgoing links

    def _dial(self, link: PeerLink) -> None:
        if link.conn is not None or link.addr in self.dropped or self.state == proto.STATE_SHUTTING_DOWN:
            return
        sock = _socket.socket(_family(link.addr), _socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            # Dial from this node's own address so the peer sees who is calling.
            sock.bind((self.settings.bind_ip, 0))
            err = sock.connect_ex((link.addr, self.settings.server_port))
        except OSError as exc:
            sock.close()
            self._link_down(link, link.status, f"cannot dial: {exc.strerror}")
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._link_down(link, link.status, os.strerror(err))
            return
        conn = Conn(sock, _OUT, _CONNECTING, link.addr, time.monotonic())
        conn.writing = True
        link.conn = conn
        self._register(conn, _EPOLLOUT)

    def _finish_connect(self, conn: Conn, *, broken: bool) -> None:
        err = conn.sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
        if err:
            self._lost(conn, os.strerror(err))
            return
        try:
            conn.sock.getpeername()
        except OSError:
            if broken:
                self._lost(conn, "connection failed")
            return  # otherwise a stale event for a reused fd: the connect is still in progress
        conn.phase = _HANDSHAKE
        conn.writing = False
        self.epoll.modify(conn.fd, _EPOLLIN)
        hello = {"domain": self.settings.domain_id, "addr": self.settings.bind_ip, "instance": self.instance}
        self._send(conn, proto.encode(proto.HELLO, hello))

    def _on_outgoing_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        link = self.links.get(conn.addr)
        if link is None or link.conn is not conn:
            self._close(conn)
            return
        if conn.phase == _HANDSHAKE:
            if verb == proto.WELCOME:
                if fields.get("domain", "") != self.settings.domain_id:
                    # The peer should have refused us; do not trust a link it accepted anyway.
                    self._close(conn)
                    self._refused(
                        link, proto.REFUSE_DOMAIN_MISMATCH, _mismatch(fields.get("domain", ""), self)
                    )
                    return
                conn.phase = _OPEN
                link.status = proto.CONN_CONNECTED
                link.reason = ""
                link.backoff = RECONNECT_INITIAL_S
                link.ever_connected = True
                link.refusals = 0
                self.log.write(
                    "INFO",
                    f"Connection established to node {self._index(link.addr)} with ip address {link.addr}",
                )
                self._update_state()
            elif verb == proto.REFUSE:
                self._close(conn)
                self._refused(link, fields.get("code", ""), fields.get("reason", ""))
            else:
                self._lost(conn, f"unexpected {verb} during handshake")
        elif verb == proto.BYE:
            self._close(conn)
            link.backoff = RECONNECT_INITIAL_S
            self._link_down(link, proto.CONN_DISCONNECTED, "peer is shutting down")
        # PING: receiving it already refreshed last_recv.

    def _refused(self, link: PeerLink, code: str, reason: str) -> None:
        status = (
            proto.CONN_NODE_MAP_MISMATCH if code == proto.REFUSE_DOMAIN_MISMATCH else proto.CONN_DISCONNECTED
        )
        if not link.ever_connected and status != proto.CONN_NODE_MAP_MISMATCH:
            status = proto.CONN_NEVER_CONNECTED
        link.refusals += 1
        if link.refusals % REFUSAL_LOG_EVERY == 1 or code != link.reason.partition(":")[0]:
            self.log.write(
                "WARNING",
                f"Connection to node {self._index(link.addr)} ({link.addr}) refused by the peer: "
                f"{reason or code} (attempt {link.refusals})",
            )
        self._link_down(link, status, f"{code}: {reason}" if reason else code, quiet=True)

    def _link_down(self, link: PeerLink, status: str, reason: str, *, quiet: bool = False) -> None:
        was_connected = link.status == proto.CONN_CONNECTED
        link.conn = None
        link.status = status
        link.reason = reason
        if was_connected and not quiet:
            self.log.write(
                "WARNING", f"Lost connection to node {self._index(link.addr)} ({link.addr}): {reason}"
            )
        if link.addr not in self.dropped and self.state != proto.STATE_SHUTTING_DOWN:
            jitter = 0.8 + (time.monotonic_ns() >> 10) % 400 / 1000  # 0.8 .. 1.2 without `random`
            link.next_attempt = time.monotonic() + link.backoff * jitter
            link.backoff = min(link.backoff * 2, max(self.settings.reconnect_max_s, RECONNECT_INITIAL_S))
        self._update_state()

    # ------------------------------------------------------------------------ incoming links

    def _on_incoming_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        if conn.phase == _OPEN:
            if verb == proto.BYE:
                self._lost(conn, "the peer closed the link")
            return  # PING: last_recv is already refreshed
        if verb != proto.HELLO:
            self._lost(conn, f"expected HELLO, got {verb}")
            return
        addr = fields.get("addr", "")
        domain = fields.get("domain", "")
        try:
            source_ip = conn.sock.getpeername()[0]
        except OSError:
            self._close(conn)
            return
        if self.state == proto.STATE_SHUTTING_DOWN:
            self._refuse(conn, addr, proto.REFUSE_SHUTTING_DOWN, "this node is shutting down")
        elif addr in self.dropped:
            self._refuse(conn, addr, proto.REFUSE_DROPPED, "this node dropped the peer (fault injection)")
        elif domain != self.settings.domain_id:
            self._refuse(conn, addr, proto.REFUSE_DOMAIN_MISMATCH, _mismatch(domain, self))
        elif source_ip != addr:
            self._refuse(
                conn, addr, proto.REFUSE_ADDRESS_MISMATCH, f"claims {addr} but dials from {source_ip}"
            )
        else:
            conn.phase = _OPEN
            conn.addr = addr
            self.incoming.setdefault(addr, set()).add(conn)
            welcome = {
                "domain": self.settings.domain_id,
                "addr": self.settings.bind_ip,
                "instance": self.instance,
            }
            self._send(conn, proto.encode(proto.WELCOME, welcome))
            self.refused_in = {key: n for key, n in self.refused_in.items() if key[0] != addr}
            link = self.links.get(addr)
            if link is None:
                self.log.write(
                    "INFO", f"Accepted connection from {addr}, a same-domain node not in the nodes config"
                )
            elif link.conn is None and link.next_attempt is not None:
                # The peer is evidently up: dial it now instead of waiting out the backoff.
                link.backoff = RECONNECT_INITIAL_S
                link.next_attempt = None
                self._dial(link)

    def _refuse(self, conn: Conn, addr: str, code: str, reason: str) -> None:
        count = self.refused_in.get((addr, code), 0) + 1
        self.refused_in[(addr, code)] = count
        if count % REFUSAL_LOG_EVERY == 1:
            self.log.write("WARNING", f"Refused connection from {addr or '?'}: {reason} (attempt {count})")
        conn.phase = _OPEN  # nothing more is read; the reply is sent, then we close
        self._send(conn, proto.encode(proto.REFUSE, {"code": code, "reason": reason}))
        self._close(conn)

    # --------------------------------------------------------------------- command service

    def _on_command(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        if conn.phase == _OPEN:
            return  # one request per connection; ignore anything after it
        conn.phase = _OPEN
        if verb == proto.CMD_STATUS:
            self._send(conn, proto.encode(proto.CMD_STATUS, self._status_fields()))
        elif verb == proto.CMD_CRASH:
            self.log.write("ERROR", "Fault injected: crash, exiting with status 1")
            self._reply_now(conn, proto.encode(proto.REPLY_OK))
            os._exit(EXIT_ERROR)
        elif verb == proto.CMD_HANG:
            self.log.write("ERROR", "Fault injected: hang (no more replies, heartbeats or signal handling)")
            self._reply_now(conn, proto.encode(proto.REPLY_OK))
            while True:  # a hung daemon: only SIGKILL ends it
                time.sleep(3600)
        elif verb == proto.CMD_DROP:
            addr = fields.get("addr", "")
            if not addr:
                self._send(conn, proto.encode(proto.REPLY_ERR, {"reason": "DROP needs addr=<address>"}))
                return
            self._drop_peer(addr)
            self._send(conn, proto.encode(proto.REPLY_OK))
        elif verb == proto.CMD_HEAL:
            self._heal("heal command")
            self._send(conn, proto.encode(proto.REPLY_OK))
        else:
            self._send(conn, proto.encode(proto.REPLY_ERR, {"reason": f"unknown command {verb}"}))

    def _reply_now(self, conn: Conn, data: bytes) -> None:
        # Best effort before exit/hang: a short reply fits in the socket buffer.
        try:
            conn.sock.send(data)
        except OSError:
            pass

    def _status_fields(self) -> dict[str, str]:
        fields = {
            "state": self.state,
            "pid": str(os.getpid()),
            "addr": self.settings.bind_ip,
            "domain": self.settings.domain_id,
            "version": proto.SIM_VERSION,
            "host": self.settings.node_name,
            "nodes": ",".join(self.nodes),
            "dropped": ",".join(sorted(self.dropped)),
        }
        for addr in self.nodes:
            link = self.links.get(addr)
            if link is None:  # this node itself
                fields[f"conn.{addr}"] = proto.CONN_CONNECTED
            else:
                fields[f"conn.{addr}"] = link.status
                if link.reason:
                    fields[f"why.{addr}"] = link.reason
        return fields

    def _drop_peer(self, addr: str) -> None:
        self.dropped.add(addr)
        self.log.write("WARNING", f"Fault injected: dropping peer {addr} until SIGUSR1 or heal")
        link = self.links.get(addr)
        if link is not None:
            if link.conn is not None:
                self._close(link.conn)
            link.next_attempt = None
            self._link_down(link, proto.CONN_DISCONNECTED, "dropped (fault injection)", quiet=True)
        for conn in list(self.incoming.get(addr, ())):
            self._close(conn)

    def _heal(self, why: str) -> None:
        if self.dropped:
            self.log.write("INFO", f"Healing dropped peers {sorted(self.dropped)} ({why})")
        self.dropped.clear()
        now = time.monotonic()
        for link in self.links.values():
            if link.conn is None:
                link.backoff = RECONNECT_INITIAL_S
                link.next_attempt = now

    # ---------------------------------------------------------------- signals and membership

    def _handle_signals(self) -> None:
        try:
            data = os.read(self.wakeup_r, 512)
        except BlockingIOError:
            return
        for signum in data:
            name = _SIGNAL_NAMES.get(signum, str(signum))
            if signum in _SHUTDOWN_SIGNALS:
                self.log.write("INFO", f"Received {name}, shutting down")
                self._shutdown()
                return
            if signum == _signal.SIGUSR1:
                self._on_sigusr1()
            elif signum == _signal.SIGHUP:
                self.log.write("INFO", "Received SIGHUP (the simulator keeps no verbose log buffer)")

    def _on_sigusr1(self) -> None:
        now = time.monotonic()
        if now - self.last_sigusr1 < self.settings.sigusr1_min_interval_s:
            self.log.write("WARNING", "Received SIGUSR1 within the rate-limit window, ignored")
            return
        self.last_sigusr1 = now
        self.log.write("INFO", "Received SIGUSR1: re-reading the nodes config and reconnecting peers")
        try:
            nodes = read_nodes_config(self.settings.nodes_config_file)
        except OSError as exc:
            self.log.write("ERROR", f"Failed to read node configuration file {exc.filename}: {exc.strerror}")
            return
        self._heal("SIGUSR1")
        self._apply_nodes(nodes, reason="SIGUSR1")

    def _apply_nodes(self, nodes: list[str], reason: str) -> None:
        own = self.settings.bind_ip
        wanted = [addr for addr in dict.fromkeys(nodes) if addr != own]
        removed = [addr for addr in self.links if addr not in wanted]
        added = [addr for addr in wanted if addr not in self.links]
        for addr in removed:
            link = self.links.pop(addr)
            if link.conn is not None:
                if link.conn.phase == _OPEN:
                    self._send(link.conn, proto.encode(proto.BYE))
                self._close(link.conn)
            for conn in list(self.incoming.get(addr, ())):
                self._close(conn)
        self.nodes = list(nodes)
        self.links = {addr: self.links.get(addr) or PeerLink(addr) for addr in wanted}
        if own not in nodes:
            self.log.write("WARNING", f"This node's address {own} is not in the nodes config")
        listing = ", ".join(f"#{i} {addr}{' (self)' if addr == own else ''}" for i, addr in enumerate(nodes))
        self.log.write("INFO", f"Nodes config ({reason}): {len(nodes)} node(s): {listing or 'none'}")
        if reason != "start" and (added or removed):
            self.log.write("INFO", f"Peers added: {added or 'none'}; removed: {removed or 'none'}")
        for addr in added:
            self._dial(self.links[addr])
        self._update_state()

    def _update_state(self) -> None:
        if self.state in (proto.STATE_SHUTTING_DOWN, proto.STATE_INITIALIZING):
            return
        connected = sum(1 for link in self.links.values() if link.status == proto.CONN_CONNECTED)
        if self.settings.wait_for_quorum == keys.QUORUM_NONE or connected == len(self.links):
            new = proto.STATE_READY
        else:
            new = proto.STATE_WAITING_FOR_PEERS
        if new != self.state:
            self.log.write(
                "INFO",
                f"IMEX daemon state {self.state} -> {new} ({connected}/{len(self.links)} peers connected)",
            )
            self.state = new

    def _shutdown(self) -> None:
        self.state = proto.STATE_SHUTTING_DOWN
        for conn in list(self.conns.values()):
            if conn.kind != _CMD and conn.phase == _OPEN:
                self._reply_now(conn, proto.encode(proto.BYE))
            self._close(conn)
        for listener in (self.peer_listener, self.cmd_listener):
            if listener is not None:
                listener.close()
        self.log.write("INFO", "IMEX daemon stopped")
        self.exit_code = EXIT_OK

    def _index(self, addr: str) -> int:
        try:
            return self.nodes.index(addr)
        except ValueError:
            return -1


def _ignore_signal(signum: int, frame: object) -> None:
    """Python-level handler: the wakeup pipe carries the signal to the event loop."""


def _family(ip: str) -> int:
    return _socket.AF_INET6 if ":" in ip else _socket.AF_INET


def _mismatch(peer_domain: str, daemon: Daemon) -> str:
    return (
        f"node map mismatch: peer domain {peer_domain or '<none>'}, "
        f"local domain {daemon.settings.domain_id or '<none>'}"
    )


def read_nodes_config(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return parse_nodes_config(f.read())


def _parse_args(argv: list[str]) -> str:
    """Return the config path from ``-c <path>`` (the only option, as used with nvidia-imex)."""
    if len(argv) == 2 and argv[0] in ("-c", "--config"):
        return argv[1]
    if len(argv) == 1 and argv[0].startswith("--config="):
        return argv[0].partition("=")[2]
    raise ConfigError("usage: imex-sim -c <config.cfg>")


def main(argv: list[str] | None = None) -> int:
    """Run the simulated daemon; returns the process exit status."""
    try:
        config_path = _parse_args(sys.argv[1:] if argv is None else argv)
        with open(config_path, encoding="utf-8") as f:
            settings = Settings(parse_imex_config(f.read()), config_path)
    except (ConfigError, OSError) as exc:
        print(f"imex-sim: {exc}", file=sys.stderr)
        return EXIT_ERROR
    s = settings
    log = DaemonLog(s.log_file, s.log_level, s.log_append, s.log_max_bytes, s.log_rotate_count)
    if log.open_error:
        log.write("WARNING", log.open_error)
    log.write(
        "INFO", f"IMEX simulator {proto.SIM_VERSION} starting (pid {os.getpid()}, config {config_path})"
    )
    log.write(
        "INFO",
        f"Configuration: BIND_INTERFACE_IP={s.bind_ip} SERVER_PORT={s.server_port} "
        f"IMEX_NODE_CONFIG_FILE={s.nodes_config_file} IMEX_WAIT_FOR_QUORUM={s.wait_for_quorum} "
        f"IMEX_CMD_ENABLED={int(s.cmd_enabled)} IMEX_CMD_BIND_INTERFACE_IP={s.cmd_ip} "
        f"IMEX_CMD_PORT={s.cmd_port} domain={s.domain_id or '<none>'}",
    )
    if s.daemonize:
        log.write("WARNING", "DAEMONIZE=1 is not supported by the simulator; staying in the foreground")
    try:
        nodes = read_nodes_config(s.nodes_config_file)
    except OSError as exc:
        log.write("ERROR", f"Failed to read node configuration file {s.nodes_config_file}: {exc.strerror}")
        log.close()
        return EXIT_ERROR
    daemon = Daemon(s, log)
    try:
        daemon.start(nodes)
    except OSError as exc:
        log.write("ERROR", f"{exc.strerror}; exiting")
        log.close()
        return EXIT_ERROR
    code = daemon.run()
    log.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
