"""The peer links of the simulated IMEX daemon: connections, handshake checks, reconnects.

``PeerMesh`` is the network half of the daemon (``tools.sim.imex.daemon`` adds the command
service, signals, imports and start-up). It listens for peers, keeps one outgoing link per other
node ID of the map, and checks every handshake as strictly as nvidia-imex:

* every dial attempt resolves the node's name afresh (``HostsResolver`` re-reads the hosts file
  when it changed); an unresolvable name leaves the link down with the reason;
* a link that goes down is re-dialled after a backoff that starts at ``reconnect_initial_s``
  and doubles up to ``reconnect_max_s`` (0.5 s and 3 s by default, as nvidia-imex); an incoming
  connection from that peer does not shorten it;
* the acceptor refuses a HELLO with another node map digest or SIM_DOMAIN_ID
  (NODE_MAP_MISMATCH), a node ID out of range or equal to its own, a dropped node (fault), and
  a source address that is not what that node ID's name resolves to now;
* each side pings over its own outgoing link, and a link silent for three heartbeat intervals
  is dead;
* ``cut_links`` (fault injection) stands for a network partition of this node: for a while no
  peer byte is read or sent, nothing is accepted and every dial times out, while the command
  service keeps answering. Peers see their links fall silent and time out, as behind a dead switch
  port; unread and unsent bytes wait in the socket buffers, as TCP keeps them, so a link that has
  not timed out yet carries on afterwards.

Every instance a handshake shows and every BYE goes to the ``_instance_seen``/``_exporter_gone``
hooks (imports). One thread, epoll, C-level ``_socket``: start-up time is a product target.
"""

from __future__ import annotations

import _socket
import errno
import os
import select
import time

from libs.imex.slots import nodes_map_digest
from tools.sim.imex import protocol as proto
from tools.sim.imex.daemon_log import DaemonLog
from tools.sim.imex.resolver import HostsResolver
from tools.sim.imex.settings import Settings

TYPE_CHECKING = False
if TYPE_CHECKING:
    from tools.sim.imex.mesh_tls import MeshTls, TlsChannel

HEARTBEAT_TIMEOUT_FACTOR = 3.0  # a link silent for this many heartbeat intervals is dead
LISTEN_BACKLOG = 128
LOG_EVERY = 50  # a repeated attempt or refusal is logged once, then every Nth time

_PING_LINE = proto.encode(proto.PING).rstrip(b"\n")
_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_EPOLL_BROKEN = select.EPOLLERR | select.EPOLLHUP

# Link phases.
_CONNECTING = "connecting"  # TCP connect in progress (outgoing only)
_TLS = "tls"  # TLS handshake before HELLO (outgoing only; incoming waits for HELLO meanwhile)
_HANDSHAKE = "handshake"  # waiting for HELLO (incoming) or WELCOME/REFUSE (outgoing)
OPEN = "open"
# Connection kinds.
_OUT = "out"
_IN = "in"
INCOMING = _IN
CMD = "cmd"


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
        "tls",
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
        self.tls: TlsChannel | None = None  # peer links of a mesh with TLS on


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


class PeerMesh:
    """Listeners and peer links of one daemon (one thread); the subclass adds the rest."""

    def __init__(
        self, settings: Settings, log: DaemonLog, names: list[str], own_id: int, resolver: HostsResolver
    ) -> None:
        self.settings = settings
        self.log = log
        self.names = names  # the nodes config, in ID order; never re-read
        self.own_id = own_id
        self.resolver = resolver
        # Raises ConfigError when a credential file is unusable: the daemon does not initialise.
        self.mesh_tls: MeshTls | None = None
        if settings.mesh_tls is not None:
            # Imported only with TLS on: loading OpenSSL costs every daemon's start-up otherwise.
            from tools.sim.imex.mesh_tls import MeshTls

            self.mesh_tls = MeshTls(settings.mesh_tls, settings.security_target_override)
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
        self.dropped: set[int] = set()
        self.heard: dict[int, float] = {}  # node ID -> last message from it on any link
        self.refused_in: dict[tuple[str, str], int] = {}  # (source address, code) -> times refused
        self.peer_listener: _socket.socket | None = None
        self.cmd_listener: _socket.socket | None = None
        self.wakeup_r = -1
        self.next_tick = 0.0
        self.cut_until: float | None = None  # peer links cut (fault) until then

    # ------------------------------------------------------------------ hooks of the subclass

    def _on_command(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        raise NotImplementedError

    def _handle_signals(self) -> None:
        raise NotImplementedError

    def _instance_seen(self, node_id: int, instance: str) -> None:
        """A handshake showed ``node_id`` running ``instance``."""

    def _exporter_gone(self, conn: Conn) -> None:
        """The peer on ``conn`` said BYE: it is shutting down."""

    def _peer_reloaded(self, node_id: int) -> None:
        """``node_id`` reloaded its TLS credentials and asks this daemon to reload too."""

    def _peer_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        """Any other message of a peer on an open incoming link."""

    # ------------------------------------------------------------------------------ the loop

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

    def _next_deadline(self) -> float:
        deadline = self.next_tick
        if self.cut_until is not None and self.cut_until < deadline:
            deadline = self.cut_until
        for link in self.links.values():
            if link.next_attempt is not None and link.next_attempt < deadline:
                deadline = link.next_attempt
        return deadline

    def _dispatch(self, fd: int, mask: int) -> None:
        if self.peer_listener is not None and fd == self.peer_listener.fileno():
            self._accept(self.peer_listener, _IN)
        elif self.cmd_listener is not None and fd == self.cmd_listener.fileno():
            self._accept(self.cmd_listener, CMD)
        elif fd == self.wakeup_r:
            self._handle_signals()
        else:
            conn = self.conns.get(fd)
            if conn is None:
                return
            if self.cut_until is not None and conn.kind != CMD:
                if mask & _EPOLL_BROKEN:  # registered for nothing while cut: only errors get here
                    self._lost(conn, "connection reset")
                return
            if conn.phase == _CONNECTING:
                self._finish_connect(conn, broken=bool(mask & _EPOLL_BROKEN))
                return
            if mask & (_EPOLLIN | _EPOLL_BROKEN):
                self._read(conn)
            if mask & _EPOLLOUT and self.conns.get(fd) is conn:
                self._flush(conn)

    def _run_timers(self, now: float) -> None:
        if self.cut_until is not None and now >= self.cut_until:
            self._restore_links()
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
            if conn.phase == OPEN and conn.kind != CMD:
                heard = max(heard, self.heard.get(conn.node_id, heard))
            if now - heard >= dead_after:
                what = "handshake" if conn.phase != OPEN else "heartbeat"
                self._lost(conn, f"{what} timeout ({dead_after:g} s without a message)")
            elif (
                conn.phase == OPEN
                and now - conn.last_sent >= interval
                and (conn.kind == _OUT or (conn.kind == _IN and not self._has_open_link(conn.node_id)))
            ):
                self._send(conn, proto.encode(proto.PING))

    def _has_open_link(self, node_id: int) -> bool:
        link = self.links.get(node_id)
        return link is not None and link.conn is not None and link.conn.phase == OPEN

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
            conn = Conn(sock, kind, _HANDSHAKE, -1, time.monotonic())
            if kind == _IN:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
                if self.mesh_tls is not None:
                    conn.tls = self.mesh_tls.accept()
            self._register(conn, _EPOLLIN)

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
        if conn.tls is not None:
            conn.tls.encrypt(data)
            data = conn.tls.pending()
        conn.wbuf += data
        conn.last_sent = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        if self.cut_until is not None and conn.kind != CMD:
            return  # partitioned: the bytes wait, as TCP would keep them
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
        elif conn.kind == CMD and conn.phase == OPEN:
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
        if conn.tls is not None:
            data = self._decrypt(conn, data)
            if not data:
                return
        if conn.node_id >= 0 and conn.phase == OPEN and conn.kind != CMD:
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

    def _decrypt(self, conn: Conn, data: bytes) -> bytes:
        """Plaintext of ``data`` (b"" while the handshake runs); a TLS failure ends the connection."""
        from tools.sim.imex.mesh_tls import TlsError  # loaded already: conn.tls is one of its

        tls = conn.tls
        assert tls is not None
        try:
            plain = tls.receive(data)
        except TlsError as exc:
            self._send_raw(conn, tls.pending())  # e.g. the alert that tells the peer why
            if conn.kind == _IN and conn.phase != OPEN:
                self._refuse_tls(conn, str(exc))
            else:
                self._lost(conn, str(exc))
            return b""
        self._send_raw(conn, tls.pending())
        if conn.phase == _TLS and tls.established and self.conns.get(conn.fd) is conn:
            conn.phase = _HANDSHAKE
            self._send(conn, proto.encode(proto.HELLO, self._identity()))
        return plain

    def _send_raw(self, conn: Conn, data: bytes) -> None:
        if data and self.conns.get(conn.fd) is conn:
            conn.wbuf += data
            self._flush(conn)

    def _refuse_tls(self, conn: Conn, reason: str) -> None:
        try:
            source = conn.sock.getpeername()[0]
        except OSError:
            source = "?"
        count = self.refused_in.get((source, proto.REFUSE_TLS), 0) + 1
        self.refused_in[(source, proto.REFUSE_TLS)] = count
        if count % LOG_EVERY == 1:
            self.log.write("WARNING", f"Refused connection from {source}: {reason} (attempt {count})")
        self._close(conn)

    def _lost(self, conn: Conn, reason: str) -> None:
        """A connection ended (closed, failed or timed out)."""
        self._close(conn)
        if conn.kind == _OUT:
            link = self.links.get(conn.node_id)
            if link is not None and link.conn is conn:
                status = proto.CONN_DISCONNECTED if link.ever_connected else proto.CONN_NEVER_CONNECTED
                self._link_down(link, status, reason)
        elif conn.kind == _IN and conn.phase == OPEN and conn.node_id >= 0:
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
        if self.cut_until is not None:
            self._link_down(link, status, f"{address}: connection timed out", quiet=True)
            return
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
        conn.writing = False
        self.epoll.modify(conn.fd, _EPOLLIN)
        if self.mesh_tls is None:
            conn.phase = _HANDSHAKE
            self._send(conn, proto.encode(proto.HELLO, self._identity()))
            return
        link = self.links[conn.node_id]
        conn.phase = _TLS
        from tools.sim.imex.mesh_tls import TlsError

        conn.tls = self.mesh_tls.dial(link.name)
        try:
            conn.tls.start()
        except TlsError as exc:
            self._lost(conn, str(exc))
            return
        self._send_raw(conn, conn.tls.pending())

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
        elif verb == proto.RELOAD:
            self._peer_reloaded(conn.node_id)
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
        conn.phase = OPEN
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
        if conn.phase == OPEN:
            if verb == proto.BYE:
                self._close(conn)
                self._exporter_gone(conn)
                self.log.write("INFO", f"Incoming connection from node {conn.node_id} ended: peer said BYE")
            elif verb == proto.RELOAD:
                self._peer_reloaded(conn.node_id)
            elif verb != proto.PING:
                self._peer_message(conn, verb, fields)
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
        if not code and conn.tls is not None:
            code, reason = self._check_certificate(conn.tls, node_id)
        if code:
            self._refuse(conn, source, code, reason)
            return
        conn.phase = OPEN
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

    def _check_certificate(self, tls: TlsChannel, node_id: int) -> tuple[str, str]:
        """The TLS client certificate must name the slot of the node ID the dialler claims."""
        names = tls.peer_dns_names()
        if self.names[node_id].lower() in (n.lower() for n in names):
            return "", ""
        return proto.REFUSE_CERTIFICATE_MISMATCH, (
            f"the client certificate names {', '.join(names) or 'no host'}, not node {node_id}'s "
            f"{self.names[node_id]}"
        )

    def _refuse(self, conn: Conn, source: str, code: str, reason: str) -> None:
        count = self.refused_in.get((source, code), 0) + 1
        self.refused_in[(source, code)] = count
        if count % LOG_EVERY == 1:
            self.log.write("WARNING", f"Refused connection from {source}: {reason} (attempt {count})")
        conn.phase = OPEN  # nothing more is read; the reply is sent, then we close
        self._send(conn, proto.encode(proto.REFUSE, {"code": code, "reason": reason}))
        self._close(conn)

    # ---------------------------------------------------------------------- partition fault

    def cut_links(self, seconds: float) -> None:
        """Partition this node's peer links for ``seconds`` (from now; a repeat extends it)."""
        now = time.monotonic()
        already = self.cut_until is not None
        self.cut_until = max(self.cut_until or now, now + seconds)
        self.log.write("WARNING", f"Fault injected: IMEX network links cut for {seconds:g} s")
        if already:
            return
        if self.peer_listener is not None:
            self.epoll.modify(self.peer_listener.fileno(), 0)
        for conn in self.conns.values():
            if conn.kind != CMD:
                self.epoll.modify(conn.fd, 0)

    def _restore_links(self) -> None:
        self.cut_until = None
        self.log.write("INFO", "IMEX network links restored (fault over)")
        if self.peer_listener is not None:
            self.epoll.modify(self.peer_listener.fileno(), _EPOLLIN)
        for conn in list(self.conns.values()):
            if conn.kind == CMD or self.conns.get(conn.fd) is not conn:
                continue
            conn.writing = conn.phase == _CONNECTING
            self.epoll.modify(conn.fd, _EPOLLOUT if conn.writing else _EPOLLIN)
            if not conn.writing:
                self._flush(conn)

    def _connected_ids(self) -> list[int]:
        """Peer node IDs with an open link in either direction."""
        return [i for i in self.links if i in self.incoming or self._has_open_link(i)]


def _family(ip: str) -> int:
    return _socket.AF_INET6 if ":" in ip else _socket.AF_INET


def _map_mismatch(peer: dict[str, str], daemon: PeerMesh) -> str:
    return (
        f"node map mismatch: peer map {peer.get('map') or '<none>'} domain {peer.get('domain') or '<none>'}, "
        f"local map {daemon.map_digest} domain {daemon.settings.domain_id or '<none>'}"
    )
