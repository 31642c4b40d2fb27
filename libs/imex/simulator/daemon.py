"""Simulated nvidia-imex daemon: ``python -m libs.imex.simulator.daemon -c <config.cfg>``.

At least as strict as the real daemon, so that what works against it works against nvidia-imex:

* config.cfg and the nodes config are read once, at start. Entries are host names (resolved
  through the ``# SIM_HOSTS_FILE`` hosts file, the simulator's /etc/hosts) or literal IPs. The
  node's own ID is fixed then: the entry resolving to ``BIND_INTERFACE_IP``. No such entry, more
  than one, or a repeated entry: an ERROR line in the log and exit status 1.
* One outgoing link per other entry. Every dial attempt resolves the name afresh (the hosts
  file is re-read when it changed); an unresolvable name leaves the link down with the reason.
  Reconnect backoff: 0.5 s doubling to 3 s (``# SIM_RECONNECT_INITIAL_S``/``_MAX_S`` for tests).
  There is no "dial back at once because the peer dialled us" shortcut.
* Handshake: the dialler's HELLO carries the domain, its node ID and instance, its address and
  the digest of its node map (the list of names). The acceptor refuses a different map
  (``NODE_MAP_MISMATCH`` at the dialler: slot names embed the domain uid, so this is what keeps
  domains apart, upstream #1447), a node ID out of range or equal to its own, and a source
  address that is not what that ID's name resolves to now. ``# SIM_DOMAIN_ID`` is compared too.
* ``nvidia-imex-ctl -q``: ``READY`` as soon as the daemon listens with its ID identified (local
  only; no peer needed). ``-N``: this daemon's links to every node of its map.
* SIGUSR1 (at most once per 5 s, ``# SIM_SIGUSR1_MIN_INTERVAL_S``; a repeat is logged and
  ignored): re-resolve every name, close and re-dial every outgoing link at once, heal
  drop-peer faults. The nodes config is NOT re-read; imports are unaffected.
* Imports (``IMPORT``/``IMPORTS``/``UNIMPORT`` on the command service): what local jobs imported
  from which node ID's daemon instance. Invalid once a handshake shows that node running another
  instance (it restarted) or it said BYE (SIGTERM); never on a plain reconnect.
* SIGTERM, SIGINT, SIGQUIT: BYE to every peer, exit 0. A new instance ID at every start.
  SIGHUP is logged and otherwise ignored.

Faults (command service): ``CRASH`` exits 1 at once; ``HANG`` blocks the process for good (only
SIGKILL ends it); ``DROP`` cuts one peer and refuses it until SIGUSR1 or ``HEAL``.

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

from libs.imex.config import parse_imex_config, parse_nodes_config
from libs.imex.simulator import protocol as proto
from libs.imex.simulator.daemonlog import DaemonLog
from libs.imex.simulator.imports import ImportTable
from libs.imex.simulator.resolver import HostsResolver, is_ip
from libs.imex.simulator.settings import ConfigError, Settings
from libs.imex.slots import nodes_map_digest

EXIT_OK = 0
EXIT_ERROR = 1  # bad configuration, own ID not found, bind failure, injected crash

HEARTBEAT_TIMEOUT_FACTOR = 3.0  # a link silent for this many heartbeat intervals is dead
LISTEN_BACKLOG = 128
LOG_EVERY = 50  # a repeated attempt or refusal is logged once, then every Nth time

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


class Conn:
    """One TCP connection: a peer link (either direction) or a command-service client."""

    __slots__ = (
        "fd",
        "instance",
        "kind",
        "last_recv",
        "last_sent",
        "node_id",
        "phase",
        "rbuf",
        "sock",
        "wbuf",
        "writing",
    )

    def __init__(self, sock: _socket.socket, kind: str, phase: str, node_id: int, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.kind = kind
        self.phase = phase
        self.node_id = node_id  # the peer's ID (outgoing: known; incoming: after HELLO; else -1)
        self.instance = ""  # the peer's instance, once the handshake told it
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.last_recv = now
        self.last_sent = now
        self.writing = False  # registered for EPOLLOUT


class PeerLink:
    """This node's outgoing link to one other node ID, and what `-N` shows for it."""

    __slots__ = (
        "address",
        "attempts",
        "backoff",
        "conn",
        "ever_connected",
        "name",
        "next_attempt",
        "node_id",
        "reason",
        "refusals",
        "status",
    )

    def __init__(self, node_id: int, name: str, backoff: float) -> None:
        self.node_id = node_id
        self.name = name
        self.address = ""  # what the name resolved to at the last attempt
        self.conn: Conn | None = None
        self.status = proto.CONN_NEVER_CONNECTED
        self.reason = ""
        self.backoff = backoff
        self.next_attempt: float | None = None
        self.ever_connected = False
        self.refusals = 0
        self.attempts = 0  # dial attempts since the link was last up


class Daemon:
    """The simulated daemon: listeners, peer links, command service, signals (one thread)."""

    def __init__(
        self, settings: Settings, log: DaemonLog, names: list[str], own_id: int, resolver: HostsResolver
    ) -> None:
        self.settings = settings
        self.log = log
        self.names = names  # the nodes config, in ID order; never re-read
        self.own_id = own_id
        self.resolver = resolver
        self.map_digest = nodes_map_digest(names)
        self.state = proto.STATE_INITIALIZING
        self.instance = f"{os.getpid()}.{time.time_ns()}"
        self.epoll = select.epoll()
        self.conns: dict[int, Conn] = {}
        self.links = {
            i: PeerLink(i, name, settings.reconnect_initial_s) for i, name in enumerate(names) if i != own_id
        }
        self.incoming: dict[int, set[Conn]] = {}  # open incoming links by peer node ID
        self.instances: dict[int, str] = {}  # node ID -> its instance in the latest handshake
        self.imports = ImportTable()
        self.dropped: set[int] = set()
        self.heard: dict[int, float] = {}  # node ID -> last message from it on any link
        self.refused_in: dict[tuple[str, str], int] = {}  # (source address, code) -> times refused
        self.peer_listener: _socket.socket | None = None
        self.cmd_listener: _socket.socket | None = None
        self.wakeup_r = -1
        self.last_sigusr1 = -1e18
        self.next_tick = 0.0
        self.exit_code: int | None = None

    # ----------------------------------------------------------------- start-up and main loop

    def start(self) -> None:
        """Bind the listeners and begin dialling peers. Raises OSError if a bind fails."""
        s = self.settings
        self._install_signal_handlers()
        self.peer_listener = self._listen(s.bind_ip, s.server_port, "peer service")
        if s.cmd_enabled:
            self.cmd_listener = self._listen(s.cmd_ip, s.cmd_port, "command service")
        self.log.write("INFO", f"Creating connections to all peers (nPeers = {len(self.links)}).")
        self._set_state(proto.STATE_READY)
        for link in self.links.values():
            self._dial(link)
        self.next_tick = time.monotonic() + self.settings.heartbeat_s / 2

    def run(self) -> int:
        while True:
            timeout = self._next_deadline() - time.monotonic()
            for fd, mask in self.epoll.poll(max(timeout, 0.0)):
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
        for link in self.links.values():
            if link.next_attempt is not None and link.next_attempt <= now:
                link.next_attempt = None
                self._dial(link)
        if now >= self.next_tick:
            self.next_tick = now + self.settings.heartbeat_s / 2
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
                heard = max(heard, self.heard.get(conn.node_id, heard))
            if now - heard >= dead_after:
                what = "handshake" if conn.phase != _OPEN else "heartbeat"
                self._lost(conn, f"{what} timeout ({dead_after:g} s without a message)")
            elif (
                conn.phase == _OPEN
                and now - conn.last_sent >= interval
                and (conn.kind == _OUT or (conn.kind == _IN and not self._has_open_link(conn.node_id)))
            ):
                self._send(conn, proto.encode(proto.PING))

    def _has_open_link(self, node_id: int) -> bool:
        link = self.links.get(node_id)
        return link is not None and link.conn is not None and link.conn.phase == _OPEN

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.log.write("INFO", f"IMEX daemon state {self.state} -> {state}")
            self.state = state

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
            self._register(Conn(sock, kind, _HANDSHAKE, -1, time.monotonic()), _EPOLLIN)

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
        if conn.kind == _IN and conn.node_id >= 0:
            peers = self.incoming.get(conn.node_id)
            if peers is not None:
                peers.discard(conn)
                if not peers:
                    del self.incoming[conn.node_id]

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
        if conn.node_id >= 0 and conn.phase == _OPEN and conn.kind != _CMD:
            self.heard[conn.node_id] = conn.last_recv
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
            link = self.links.get(conn.node_id)
            if link is not None and link.conn is conn:
                status = proto.CONN_DISCONNECTED if link.ever_connected else proto.CONN_NEVER_CONNECTED
                self._link_down(link, status, reason)
        elif conn.kind == _IN and conn.phase == _OPEN and conn.node_id >= 0:
            self.log.write("INFO", f"Incoming connection from node {conn.node_id} ended: {reason}")

    # ------------------------------------------------------------------------ outgoing links

    def _dial(self, link: PeerLink) -> None:
        if link.conn is not None or link.node_id in self.dropped or self.state == proto.STATE_SHUTTING_DOWN:
            return
        link.attempts += 1
        # The name is resolved afresh at every attempt, as the real daemon's reconnect loop does.
        address, why = self.resolver.resolve(link.name)
        status = proto.CONN_DISCONNECTED if link.ever_connected else proto.CONN_NEVER_CONNECTED
        if not address:
            link.address = ""
            if link.attempts % LOG_EVERY == 1:
                self.log.write("WARNING", f"Node {link.node_id}: {why} (attempt #{link.attempts})")
            self._link_down(link, status, why, quiet=True)
            return
        link.address = address
        if link.attempts % LOG_EVERY == 1:
            self.log.write(
                "INFO",
                f"Attempting connection for target node {link.node_id} - {link.name}:"
                f"{self.settings.server_port} ({address}), attempt #{link.attempts}",
            )
        sock = _socket.socket(_family(address), _socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            # Dial from this node's own address: the peer checks it against our name's resolution.
            sock.bind((self.settings.bind_ip, 0))
            err = sock.connect_ex((address, self.settings.server_port))
        except OSError as exc:
            sock.close()
            self._link_down(link, status, f"cannot dial {address}: {exc.strerror}", quiet=True)
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._link_down(link, status, f"{address}: {os.strerror(err)}", quiet=True)
            return
        conn = Conn(sock, _OUT, _CONNECTING, link.node_id, time.monotonic())
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
        self._send(conn, proto.encode(proto.HELLO, self._identity()))

    def _identity(self) -> dict[str, str]:
        return {
            "domain": self.settings.domain_id,
            "node_id": str(self.own_id),
            "instance": self.instance,
            "addr": self.settings.bind_ip,
            "map": self.map_digest,
        }

    def _on_outgoing_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        link = self.links.get(conn.node_id)
        if link is None or link.conn is not conn:
            self._close(conn)
            return
        if conn.phase == _HANDSHAKE:
            if verb == proto.WELCOME:
                self._welcomed(link, conn, fields)
            elif verb == proto.REFUSE:
                self._close(conn)
                self._refused(link, fields.get("code", ""), fields.get("reason", ""))
            else:
                self._lost(conn, f"unexpected {verb} during handshake")
        elif verb == proto.BYE:
            self._close(conn)
            self._exporter_gone(conn)
            self._link_down(link, proto.CONN_DISCONNECTED, "peer is shutting down")
        # PING: receiving it already refreshed last_recv.

    def _welcomed(self, link: PeerLink, conn: Conn, fields: dict[str, str]) -> None:
        # The peer should have refused us in these cases; do not trust a link it accepted anyway.
        if fields.get("map", "") != self.map_digest or fields.get("domain", "") != self.settings.domain_id:
            self._close(conn)
            self._refused(link, proto.REFUSE_NODE_MAP_MISMATCH, _map_mismatch(fields, self))
            return
        if fields.get("node_id", "") != str(link.node_id):
            self._close(conn)
            self._refused(
                link, proto.REFUSE_INVALID_NODE_ID, f"peer at {link.address} is node {fields.get('node_id')}"
            )
            return
        conn.phase = _OPEN
        conn.instance = fields.get("instance", "")
        link.status = proto.CONN_CONNECTED
        link.reason = ""
        link.backoff = self.settings.reconnect_initial_s
        link.ever_connected = True
        link.refusals = 0
        link.attempts = 0
        self.log.write(
            "INFO", f"Connection established to node {link.node_id} with address {link.name} ({link.address})"
        )
        self._instance_seen(link.node_id, conn.instance)

    def _refused(self, link: PeerLink, code: str, reason: str) -> None:
        if code == proto.REFUSE_NODE_MAP_MISMATCH:
            status = proto.CONN_NODE_MAP_MISMATCH
        else:
            status = proto.CONN_DISCONNECTED if link.ever_connected else proto.CONN_NEVER_CONNECTED
        link.refusals += 1
        if link.refusals % LOG_EVERY == 1 or code != link.reason.partition(":")[0]:
            self.log.write(
                "WARNING",
                f"Connection to node {link.node_id} ({link.name} at {link.address}) refused by the peer: "
                f"{reason or code} (attempt {link.refusals})",
            )
        self._link_down(link, status, f"{code}: {reason}" if reason else code, quiet=True)

    def _link_down(self, link: PeerLink, status: str, reason: str, *, quiet: bool = False) -> None:
        was_connected = link.status == proto.CONN_CONNECTED
        link.conn = None
        link.status = status
        link.reason = reason
        if was_connected and not quiet:
            self.log.write("WARNING", f"Lost connection to node {link.node_id} ({link.name}): {reason}")
        if link.node_id not in self.dropped and self.state != proto.STATE_SHUTTING_DOWN:
            jitter = 0.9 + (time.monotonic_ns() >> 10) % 200 / 1000  # 0.9 .. 1.1 without `random`
            link.next_attempt = time.monotonic() + link.backoff * jitter
            link.backoff = min(link.backoff * 2, self.settings.reconnect_max_s)

    # ------------------------------------------------------------------------ incoming links

    def _on_incoming_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        if conn.phase == _OPEN:
            if verb == proto.BYE:
                self._close(conn)
                self._exporter_gone(conn)
                self.log.write("INFO", f"Incoming connection from node {conn.node_id} ended: peer said BYE")
            return  # PING: last_recv is already refreshed
        if verb != proto.HELLO:
            self._lost(conn, f"expected HELLO, got {verb}")
            return
        try:
            source = conn.sock.getpeername()[0]
        except OSError:
            self._close(conn)
            return
        raw_id = fields.get("node_id", "")
        node_id = int(raw_id) if raw_id.isdigit() else -1
        code, reason = self._check_hello(fields, node_id, source)
        if code:
            self._refuse(conn, source, code, reason)
            return
        conn.phase = _OPEN
        conn.node_id = node_id
        conn.instance = fields.get("instance", "")
        self.incoming.setdefault(node_id, set()).add(conn)
        self._send(conn, proto.encode(proto.WELCOME, self._identity()))
        self.refused_in = {key: n for key, n in self.refused_in.items() if key[0] != source}
        self._instance_seen(node_id, conn.instance)

    def _check_hello(self, fields: dict[str, str], node_id: int, source: str) -> tuple[str, str]:
        """("", "") when the dialler may connect, else (refusal code, reason)."""
        if self.state == proto.STATE_SHUTTING_DOWN:
            return proto.REFUSE_SHUTTING_DOWN, "this node is shutting down"
        if fields.get("map", "") != self.map_digest or fields.get("domain", "") != self.settings.domain_id:
            return proto.REFUSE_NODE_MAP_MISMATCH, _map_mismatch(fields, self)
        if not 0 <= node_id < len(self.names) or node_id == self.own_id:
            return proto.REFUSE_INVALID_NODE_ID, (
                f"node ID {fields.get('node_id') or '<none>'} is not another node of this map "
                f"({len(self.names)} nodes, this node is {self.own_id})"
            )
        if node_id in self.dropped:
            return proto.REFUSE_DROPPED, f"this node dropped node {node_id} (fault injection)"
        # A fresh lookup: the address a node ID may dial from is what its name resolves to now.
        expected, why = self.resolver.resolve(self.names[node_id])
        if source != expected:
            return proto.REFUSE_ADDRESS_MISMATCH, (
                f"node {node_id} ({self.names[node_id]}) dials from {source} but resolves to "
                f"{expected or why}"
            )
        return "", ""

    def _refuse(self, conn: Conn, source: str, code: str, reason: str) -> None:
        count = self.refused_in.get((source, code), 0) + 1
        self.refused_in[(source, code)] = count
        if count % LOG_EVERY == 1:
            self.log.write("WARNING", f"Refused connection from {source}: {reason} (attempt {count})")
        conn.phase = _OPEN  # nothing more is read; the reply is sent, then we close
        self._send(conn, proto.encode(proto.REFUSE, {"code": code, "reason": reason}))
        self._close(conn)

    # ------------------------------------------------------------------------------ imports

    def _instance_seen(self, node_id: int, instance: str) -> None:
        previous = self.instances.get(node_id)
        self.instances[node_id] = instance
        if previous is not None and previous != instance:
            self.log.write("WARNING", f"Node {node_id} is a new IMEX instance ({previous} -> {instance})")
        for entry in self.imports.exporter_seen(node_id, instance):
            self.log.write(
                "WARNING", f"Import of job {entry.job} from node {node_id} invalid: {entry.reason}"
            )

    def _exporter_gone(self, conn: Conn) -> None:
        for entry in self.imports.exporter_gone(conn.node_id, conn.instance):
            self.log.write(
                "WARNING", f"Import of job {entry.job} from node {conn.node_id} invalid: {entry.reason}"
            )

    def _import(self, fields: dict[str, str]) -> tuple[str, dict[str, str]]:
        job = fields.get("job", "")
        raw = fields.get("node", "")
        if not job or not raw.isdigit():
            return proto.REPLY_ERR, {"reason": "IMPORT needs job=<name> node=<node ID>"}
        link = self.links.get(int(raw))
        if link is None:
            return proto.REPLY_ERR, {"reason": f"node {raw} is not a peer of this node in its map"}
        if link.status != proto.CONN_CONNECTED or link.conn is None:
            return proto.REPLY_ERR, {"reason": f"node {raw} is not connected ({link.status}: {link.reason})"}
        self.imports.add(job, link.node_id, link.conn.instance)
        self.log.write("INFO", f"Job {job} imported memory from node {raw} (instance {link.conn.instance})")
        return proto.REPLY_OK, {"instance": link.conn.instance}

    def _imports_fields(self) -> dict[str, str]:
        entries = self.imports.listing()
        fields = {"n": str(len(entries))}
        for k, entry in enumerate(entries):
            fields[f"job.{k}"] = entry.job
            fields[f"node.{k}"] = str(entry.node_id)
            fields[f"inst.{k}"] = entry.instance
            fields[f"valid.{k}"] = "1" if entry.valid else "0"
            fields[f"why.{k}"] = entry.reason
        return fields

    # --------------------------------------------------------------------- command service

    def _on_command(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        if conn.phase == _OPEN:
            return  # one request per connection; ignore anything after it
        conn.phase = _OPEN
        reply: tuple[str, dict[str, str]] = (proto.REPLY_OK, {})
        if verb == proto.CMD_STATUS:
            reply = (proto.CMD_STATUS, self._status_fields())
        elif verb == proto.CMD_IMPORT:
            reply = self._import(fields)
        elif verb == proto.CMD_IMPORTS:
            reply = (proto.CMD_IMPORTS, self._imports_fields())
        elif verb == proto.CMD_UNIMPORT:
            reply = (proto.REPLY_OK, {"removed": str(self.imports.remove_job(fields.get("job", "")))})
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
            reply = self._drop(fields)
        elif verb == proto.CMD_HEAL:
            self._heal("heal command")
        else:
            reply = (proto.REPLY_ERR, {"reason": f"unknown command {verb}"})
        self._send(conn, proto.encode(*reply))

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
            "instance": self.instance,
            "node_id": str(self.own_id),
            "addr": self.settings.bind_ip,
            "domain": self.settings.domain_id,
            "version": proto.SIM_VERSION,
            "host": self.settings.node_name,
            "map": self.map_digest,
            "nodes": ",".join(self.names),
            "dropped": ",".join(str(i) for i in sorted(self.dropped)),
        }
        for i in range(len(self.names)):
            link = self.links.get(i)
            if link is None:  # this node itself
                fields[f"addr.{i}"] = self.settings.bind_ip
                fields[f"conn.{i}"] = proto.CONN_CONNECTED
                fields[f"inst.{i}"] = self.instance
                continue
            fields[f"addr.{i}"] = link.address
            fields[f"conn.{i}"] = link.status
            fields[f"why.{i}"] = link.reason
            fields[f"inst.{i}"] = self.instances.get(i, "")
        return fields

    def _drop(self, fields: dict[str, str]) -> tuple[str, dict[str, str]]:
        raw, addr = fields.get("node", ""), fields.get("addr", "")
        if raw.isdigit() and int(raw) in self.links:
            targets = [int(raw)]
        elif addr:
            targets = [i for i, link in self.links.items() if self.resolver.resolve(link.name)[0] == addr]
        else:
            targets = []
        if not targets:
            return proto.REPLY_ERR, {"reason": "DROP needs node=<peer node ID> or addr=<a peer's address>"}
        for node_id in targets:
            self.dropped.add(node_id)
            self.log.write("WARNING", f"Fault injected: dropping node {node_id} until SIGUSR1 or heal")
            link = self.links[node_id]
            if link.conn is not None:
                self._close(link.conn)
            link.next_attempt = None
            self._link_down(link, proto.CONN_DISCONNECTED, "dropped (fault injection)", quiet=True)
            for conn in list(self.incoming.get(node_id, ())):
                self._close(conn)
        return proto.REPLY_OK, {}

    def _heal(self, why: str) -> None:
        if self.dropped:
            self.log.write("INFO", f"Healing dropped nodes {sorted(self.dropped)} ({why})")
        self.dropped.clear()
        now = time.monotonic()
        for link in self.links.values():
            if link.conn is None:
                link.backoff = self.settings.reconnect_initial_s
                link.next_attempt = now

    # ------------------------------------------------------------------------------ signals

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
            self.log.write(
                "WARNING",
                f"Received SIGUSR1 within {self.settings.sigusr1_min_interval_s:g} s of the last one, ignored",
            )
            return
        self.last_sigusr1 = now
        self.log.write(
            "INFO", "Received SIGUSR1: re-resolving node names and restarting all peer connections"
        )
        self.resolver.refresh(force=True)
        self._heal("SIGUSR1")
        for link in self.links.values():
            if link.conn is not None:
                self._close(link.conn)
                link.conn = None
                if link.status == proto.CONN_CONNECTED:
                    link.status = proto.CONN_DISCONNECTED
                    link.reason = "restarting connections (SIGUSR1)"
            link.backoff = self.settings.reconnect_initial_s
            link.next_attempt = None
            link.attempts = 0
            self._dial(link)

    def _shutdown(self) -> None:
        self._set_state(proto.STATE_SHUTTING_DOWN)
        for conn in list(self.conns.values()):
            if conn.kind != _CMD and conn.phase == _OPEN:
                self._reply_now(conn, proto.encode(proto.BYE))
            self._close(conn)
        for listener in (self.peer_listener, self.cmd_listener):
            if listener is not None:
                listener.close()
        self.log.write("INFO", "IMEX daemon stopped")
        self.exit_code = EXIT_OK


def _ignore_signal(signum: int, frame: object) -> None:
    """Python-level handler: the wakeup pipe carries the signal to the event loop."""


def _family(ip: str) -> int:
    return _socket.AF_INET6 if ":" in ip else _socket.AF_INET


def _map_mismatch(peer: dict[str, str], daemon: Daemon) -> str:
    return (
        f"node map mismatch: peer map {peer.get('map') or '<none>'} domain {peer.get('domain') or '<none>'}, "
        f"local map {daemon.map_digest} domain {daemon.settings.domain_id or '<none>'}"
    )


class StartError(Exception):
    """The node cannot take part with this nodes config; the daemon exits with EXIT_ERROR."""


def identify(names: list[str], resolver: HostsResolver, bind_ip: str, nodes_file: str, log: DaemonLog) -> int:
    """This node's ID: the one entry of the nodes config that resolves to ``bind_ip``."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name.lower() in seen:
            raise StartError(
                f"Node config entry '{name}' is listed twice (node IDs {seen[name.lower()]} and {i}) "
                f"in the node configuration file {nodes_file}."
            )
        seen[name.lower()] = i
        if not is_ip(name):
            log.write("INFO", f"Treating node config entry '{name}' as a host name.")
    resolver.refresh(force=True)
    if resolver.error:
        log.write("WARNING", resolver.error)
    mine = [i for i, name in enumerate(names) if resolver.resolve(name, refresh=False)[0] == bind_ip]
    if not mine:
        # nvidia-imex's own words (upstream kubernetes-sigs/dra-driver-nvidia-gpu PR #298).
        raise StartError(
            f"No matching network interface found for any IP addresses in the node configuration file "
            f"{nodes_file}. (BIND_INTERFACE_IP {bind_ip} is not what any of its {len(names)} entries "
            "resolves to.)"
        )
    if len(mine) > 1:
        raise StartError(
            f"Node config entries {', '.join(names[i] for i in mine)} (IDs {mine}) all resolve to this "
            f"node's address {bind_ip}; cannot tell which node ID is this node's."
        )
    own = mine[0]
    how = "IP" if is_ip(names[own]) else "address"
    log.write("INFO", f"Identified this node as ID {own}, using bind {how} of '{names[own]}'")
    return own


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
            s = Settings(parse_imex_config(f.read()), config_path)
    except (ConfigError, OSError) as exc:
        print(f"imex-sim: {exc}", file=sys.stderr)
        return EXIT_ERROR
    log = DaemonLog(s.log_file, s.log_level, s.log_append, s.log_max_bytes, s.log_rotate_count)
    if log.open_error:
        log.write("WARNING", log.open_error)
    log.write(
        "INFO", f"IMEX simulator {proto.SIM_VERSION} starting (pid {os.getpid()}, config {config_path})"
    )
    log.write(
        "INFO",
        f"Configuration: BIND_INTERFACE_IP={s.bind_ip} SERVER_PORT={s.server_port} "
        f"IMEX_NODE_CONFIG_FILE={s.nodes_config_file} IMEX_CMD_ENABLED={int(s.cmd_enabled)} "
        f"IMEX_CMD_BIND_INTERFACE_IP={s.cmd_ip} IMEX_CMD_PORT={s.cmd_port} "
        f"hosts file={s.hosts_file or '<none>'} domain={s.domain_id or '<none>'}",
    )
    if s.daemonize:
        log.write("WARNING", "DAEMONIZE=1 is not supported by the simulator; staying in the foreground")
    resolver = HostsResolver(s.hosts_file)
    try:
        with open(s.nodes_config_file, encoding="utf-8") as f:
            names = parse_nodes_config(f.read())
        own_id = identify(names, resolver, s.bind_ip, s.nodes_config_file, log)
        daemon = Daemon(s, log, names, own_id, resolver)
        daemon.start()
    except OSError as exc:
        what = exc.strerror or str(exc)
        if exc.filename:
            what = f"Failed to read node configuration file {exc.filename}: {exc.strerror}"
        log.write("ERROR", f"{what}; exiting")
        log.close()
        return EXIT_ERROR
    except StartError as exc:
        log.write("ERROR", str(exc))
        log.close()
        return EXIT_ERROR
    code = daemon.run()
    log.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
