"""Simulated nvidia-imex daemon: ``python -m tools.sim.imex.daemon -c <config.cfg>``.

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
  drop-peer faults. The nodes config is NOT re-read; imports are unaffected. With TLS it first
  reloads the credentials and tells the peers to reload theirs; a failed reload changes nothing
  (``tools.sim.imex.reload``).
* Imports (``IMPORT``/``IMPORTS``/``UNIMPORT`` on the command service): what local jobs imported
  from which node ID's daemon instance. Invalid once a handshake shows that node running another
  instance (it restarted) or it said BYE (SIGTERM); never on a plain reconnect. With
  ``IMEX_NODE_DISCONNECTED_GRACE_TIME`` set, also once that node stayed disconnected that long
  (``tools.sim.imex.grace``).
* SIGTERM, SIGINT, SIGQUIT: BYE to every peer, exit 0. A new instance ID at every start.
  SIGHUP is logged and otherwise ignored.
* Persistence file and recovery (``recovery.py``): the nodes that imported this daemon's memory
  are kept in ``persist.dat`` beside config.cfg. After an unclean stop, a new instance with
  IMEX_WAIT_FOR_QUORUM=RECOVERY (the default) is ``WAITING_FOR_RECOVERY`` until each of them has
  reconnected; it refuses imports meanwhile. NONE, or a changed nodes config, skips the wait.
* Host names in the nodes config need driver 570.158.01 or later (``# SIM_DRIVER_VERSION``,
  the node's driver; ``libs/imex/driver.py``): on an older one, an ERROR line and exit status 1.

Faults (command service): ``CRASH`` exits 1 at once; ``HANG`` blocks the process for good (only
SIGKILL ends it); ``DROP`` cuts one peer and refuses it until SIGUSR1 or ``HEAL``; ``CUT
seconds=S`` partitions all of this node's peer links for S seconds (``PeerMesh.cut_links``).

Start-up time is a product target (many daemons start at once on small machines), so this
module uses epoll and the C-level ``_socket``/``_signal`` modules directly: importing asyncio,
socket (enum), json or random would cost several times the rest of start-up.
"""

from __future__ import annotations

import _signal
import os
import select
import sys
import time

from libs.imex.config import QUORUM_RECOVERY, parse_imex_config, parse_nodes_config
from libs.imex.driver import host_names_refusal
from tools.sim.imex import protocol as proto
from tools.sim.imex import recovery as persist
from tools.sim.imex.daemon_log import DaemonLog
from tools.sim.imex.grace import DisconnectClock
from tools.sim.imex.imports import ImportTable
from tools.sim.imex.links import CMD, OPEN, Conn
from tools.sim.imex.reload import CredentialReload
from tools.sim.imex.resolver import HostsResolver, is_ip
from tools.sim.imex.settings import ConfigError, Settings

EXIT_OK = 0
EXIT_ERROR = 1  # bad configuration, own ID not found, bind failure, injected crash

_SHUTDOWN_SIGNALS = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGQUIT)
_SIGNAL_NAMES = {
    _signal.SIGTERM: "SIGTERM",
    _signal.SIGINT: "SIGINT",
    _signal.SIGQUIT: "SIGQUIT",
    _signal.SIGUSR1: "SIGUSR1",
    _signal.SIGHUP: "SIGHUP",
}


class Daemon(CredentialReload):
    """The simulated daemon: peer links, command service, imports, signals (one thread)."""

    def __init__(
        self, settings: Settings, log: DaemonLog, names: list[str], own_id: int, resolver: HostsResolver
    ) -> None:
        super().__init__(settings, log, names, own_id, resolver)
        self.imports = ImportTable()
        self.recovery = persist.Recovery(self.map_digest, False, None, own_id, len(names))
        self.grace = DisconnectClock(settings.disconnected_grace_s)
        self.last_sigusr1 = -1e18
        self.credentials_error = ""
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
        self._start_recovery()
        self._set_state(proto.STATE_WAITING_FOR_RECOVERY if self.recovery.waiting else proto.STATE_READY)
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

    def _next_deadline(self) -> float:
        deadline = super()._next_deadline()
        grace = self.grace.next_deadline()
        return deadline if grace is None or grace > deadline else grace

    def _run_timers(self, now: float) -> None:
        super()._run_timers(now)
        if self.grace.enabled:
            for node_id in self.grace.observe(self._connected_ids(), self.instances, now):
                self.log.write(
                    "WARNING",
                    f"Node {node_id} disconnected for {self.grace.grace_s} s "
                    "(IMEX_NODE_DISCONNECTED_GRACE_TIME): cleaning up its imports and exports",
                )
                for entry in self.imports.exporter_disconnected(node_id, self.grace.grace_s):
                    self.log.write(
                        "WARNING", f"Import of job {entry.job} from node {node_id} invalid: {entry.reason}"
                    )

    def _install_signal_handlers(self) -> None:
        # The C-level handler writes each signal number into this pipe, which wakes epoll; the
        # Python-level handler only has to exist (so the default action does not kill us).
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        _signal.set_wakeup_fd(wakeup_w)
        for signum in _SIGNAL_NAMES:
            _signal.signal(signum, _ignore_signal)
        self.epoll.register(self.wakeup_r, select.EPOLLIN)

    # ------------------------------------------------------------------------------ imports

    def _instance_seen(self, node_id: int, instance: str) -> None:
        previous = self.instances.get(node_id)
        self.instances[node_id] = instance
        if previous is not None and previous != instance:
            self.log.write("WARNING", f"Node {node_id} is a new IMEX instance ({previous} -> {instance})")
            self._importers_changed(self.recovery.importer_gone(node_id))
        self._peer_reconnected(node_id)
        for entry in self.imports.exporter_seen(node_id, instance):
            self.log.write(
                "WARNING", f"Import of job {entry.job} from node {node_id} invalid: {entry.reason}"
            )

    def _exporter_gone(self, conn: Conn) -> None:
        self._importers_changed(self.recovery.importer_gone(conn.node_id))
        for entry in self.imports.exporter_gone(conn.node_id, conn.instance):
            self.log.write(
                "WARNING", f"Import of job {entry.job} from node {conn.node_id} invalid: {entry.reason}"
            )

    def _import(self, fields: dict[str, str]) -> tuple[str, dict[str, str]]:
        job = fields.get("job", "")
        raw = fields.get("node", "")
        if not job or not raw.isdigit():
            return proto.REPLY_ERR, {"reason": "IMPORT needs job=<name> node=<node ID>"}
        if self.state != proto.STATE_READY:
            return proto.REPLY_ERR, {"reason": f"this daemon is {self.state}, not READY"}
        link = self.links.get(int(raw))
        if link is None:
            return proto.REPLY_ERR, {"reason": f"node {raw} is not a peer of this node in its map"}
        if link.status != proto.CONN_CONNECTED or link.conn is None:
            return proto.REPLY_ERR, {"reason": f"node {raw} is not connected ({link.status}: {link.reason})"}
        self.imports.add(job, link.node_id, link.conn.instance)
        self._send(link.conn, proto.encode(proto.IMPORTED, {"job": job}))
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

    # ------------------------------------------------------- persistence file and recovery

    def _start_recovery(self) -> None:
        """Read the persistence file of the instance before and decide whether to wait."""
        s = self.settings
        try:
            previous = persist.load(s.persist_file)
        except OSError as exc:
            self.log.write("WARNING", f"Cannot read the persistence file {s.persist_file}: {exc.strerror}")
            previous = None
        wait = s.wait_for_quorum == QUORUM_RECOVERY
        self.recovery = persist.Recovery(self.map_digest, wait, previous, self.own_id, len(self.names))
        level = "WARNING" if self.recovery.waiting else "INFO"
        self.log.write(level, f"Persistence file {s.persist_file}: {self.recovery.decision}")
        self._save_persist(self.recovery.persisted())

    def _save_persist(self, text: str) -> None:
        try:
            persist.save(self.settings.persist_file, text)
        except OSError as exc:
            self.log.write("ERROR", f"Cannot write the persistence file {self.settings.persist_file}: {exc}")

    def _importers_changed(self, changed: bool) -> None:
        if changed:
            self._save_persist(self.recovery.persisted())

    def _peer_reconnected(self, node_id: int) -> None:
        if node_id not in self.recovery.outstanding:
            return
        address = self.resolver.resolve(self.names[node_id], refresh=False)[0]
        done = self.recovery.reconnected(node_id, address)
        if node_id in self.recovery.mismatched and node_id in self.recovery.outstanding:
            self.log.write(
                "WARNING",
                f"Node {node_id} reconnected from {address}, but the node that imported memory of the "
                f"previous instance was at {self.recovery.outstanding[node_id]}: still waiting for it",
            )
            return
        self.log.write("INFO", f"Recovery: node {node_id} ({address}) reconnected")
        self._save_persist(self.recovery.persisted())  # it has cleaned up: not waited for again
        if done:
            self.log.write("INFO", "Recovery complete: every node that had imported memory reconnected")
            self._set_state(proto.STATE_READY)

    def _peer_message(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        job = fields.get("job", "")
        if verb == proto.IMPORTED and job:
            address = self.resolver.resolve(self.names[conn.node_id], refresh=False)[0]
            self._importers_changed(self.recovery.imported(conn.node_id, address, job))
        elif verb == proto.UNIMPORTED and job:
            self._importers_changed(self.recovery.unimported(conn.node_id, job))

    def _unimport(self, job: str) -> int:
        """Drop a local job's imports and tell each exporter still connected."""
        exporters = {entry.node_id for entry in self.imports.listing() if entry.job == job and entry.valid}
        removed = self.imports.remove_job(job)
        for node_id in sorted(exporters):
            link = self.links.get(node_id)
            if link is not None and link.conn is not None and link.status == proto.CONN_CONNECTED:
                self._send(link.conn, proto.encode(proto.UNIMPORTED, {"job": job}))
        return removed

    # --------------------------------------------------------------------- command service

    def _on_command(self, conn: Conn, verb: str, fields: dict[str, str]) -> None:
        if conn.phase == OPEN:
            return  # one request per connection; ignore anything after it
        conn.phase = OPEN
        reply: tuple[str, dict[str, str]] = (proto.REPLY_OK, {})
        if verb == proto.CMD_STATUS:
            reply = (proto.CMD_STATUS, self._status_fields())
        elif verb == proto.CMD_IMPORT:
            reply = self._import(fields)
        elif verb == proto.CMD_IMPORTS:
            reply = (proto.CMD_IMPORTS, self._imports_fields())
        elif verb == proto.CMD_UNIMPORT:
            reply = (proto.REPLY_OK, {"removed": str(self._unimport(fields.get("job", "")))})
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
        elif verb == proto.CMD_CUT:
            reply = self._cut(fields)
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
            "cred_error": self.credentials_error,
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

    def _cut(self, fields: dict[str, str]) -> tuple[str, dict[str, str]]:
        try:
            seconds = float(fields.get("seconds", ""))
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= 3600:
            return proto.REPLY_ERR, {"reason": "CUT needs seconds=<s> in (0, 3600]"}
        self.cut_links(seconds)
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

    def _shutdown(self) -> None:
        self._set_state(proto.STATE_SHUTTING_DOWN)
        self._save_persist(self.recovery.persisted(shutting_down=True))  # the peers get BYE below
        for conn in list(self.conns.values()):
            if conn.kind != CMD and conn.phase == OPEN:
                self._reply_now(conn, proto.encode(proto.BYE))
            self._close(conn)
        for listener in (self.peer_listener, self.cmd_listener):
            if listener is not None:
                listener.close()
        self.log.write("INFO", "IMEX daemon stopped")
        self.exit_code = EXIT_OK


def _ignore_signal(signum: int, frame: object) -> None:
    """Python-level handler: the wakeup pipe carries the signal to the event loop."""


class StartError(Exception):
    """The node cannot take part with this nodes config; the daemon exits with EXIT_ERROR."""


def identify(
    names: list[str],
    resolver: HostsResolver,
    bind_ip: str,
    nodes_file: str,
    log: DaemonLog,
    driver_version: str,
) -> int:
    """This node's ID: the one entry of the nodes config that resolves to ``bind_ip``. Host
    names need a driver that supports them (`driver_version`, the node's)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name.lower() in seen:
            raise StartError(
                f"Node config entry '{name}' is listed twice (node IDs {seen[name.lower()]} and {i}) "
                f"in the node configuration file {nodes_file}."
            )
        seen[name.lower()] = i
        if not is_ip(name):
            refusal = host_names_refusal(driver_version)
            if refusal:
                # An older nvidia-imex takes every entry for an IP address (libs/imex/driver.py).
                raise StartError(
                    f"Invalid IP address '{name}' (node ID {i}) in the node configuration file "
                    f"{nodes_file}: {refusal}."
                )
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
        f"IMEX_WAIT_FOR_QUORUM={s.wait_for_quorum} driver={s.driver_version} "
        f"hosts file={s.hosts_file or '<none>'} domain={s.domain_id or '<none>'}",
    )
    if s.daemonize:
        log.write("WARNING", "DAEMONIZE=1 is not supported by the simulator; staying in the foreground")
    resolver = HostsResolver(s.hosts_file)
    try:
        with open(s.nodes_config_file, encoding="utf-8") as f:
            names = parse_nodes_config(f.read())
        own_id = identify(names, resolver, s.bind_ip, s.nodes_config_file, log, s.driver_version)
        daemon = Daemon(s, log, names, own_id, resolver)
        daemon.start()
    except OSError as exc:
        what = exc.strerror or str(exc)
        if exc.filename:
            what = f"Failed to read node configuration file {exc.filename}: {exc.strerror}"
        log.write("ERROR", f"{what}; exiting")
        log.close()
        return EXIT_ERROR
    except (StartError, ConfigError) as exc:
        log.write("ERROR", str(exc))
        log.close()
        return EXIT_ERROR
    code = daemon.run()
    log.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
