"""SIGUSR1 in the simulated daemon, as NVIDIA's IMEX guide ("Signal handling") describes it.

* At most one SIGUSR1 is acted on per 5 s (``SIM_SIGUSR1_MIN_INTERVAL_S``); a repeat within the
  window is logged and ignored.
* Without TLS: re-resolve every name and restart every outgoing connection.
* With TLS (credentials from files): 1. reload the six credential files; 2. tell every other
  daemon to reload its credentials (``RELOAD`` over a link with it); 3. restart the outgoing
  connections with the new credentials. If step 1 fails, steps 2 and 3 are skipped: the old
  credentials stay, no connection is restarted, and the error is logged and shown in STATUS
  (``cred_error``) until a reload succeeds.
* A daemon told ``RELOAD`` by a peer reloads its own files and, if that worked, restarts its
  outgoing connections; it tells no one further (no echo between peers).

A mixin of the daemon: it uses the daemon's links, log and settings.
"""

from __future__ import annotations

import time

from tools.sim.imex import protocol as proto
from tools.sim.imex.links import CMD, INCOMING, OPEN, PeerMesh


class CredentialReload(PeerMesh):
    """SIGUSR1 and peer-requested credential reloads (mixed into the daemon)."""

    last_sigusr1: float
    credentials_error: str

    def _on_sigusr1(self) -> None:
        now = time.monotonic()
        if now - self.last_sigusr1 < self.settings.sigusr1_min_interval_s:
            self.log.write(
                "WARNING",
                f"Received SIGUSR1 within {self.settings.sigusr1_min_interval_s:g} s of the last one, ignored",
            )
            return
        self.last_sigusr1 = now
        if self.mesh_tls is None:
            self.log.write(
                "INFO", "Received SIGUSR1: re-resolving node names and restarting all peer connections"
            )
        else:
            self.log.write("INFO", "Received SIGUSR1: reloading SSL credentials")
            if not self._reload_credentials():
                return
            self._ask_peers_to_reload()
            self.log.write("INFO", "Re-resolving node names and restarting all peer connections")
        self.resolver.refresh(force=True)
        self._heal("SIGUSR1")
        self._restart_outgoing("restarting connections (SIGUSR1)")

    def _peer_reloaded(self, node_id: int) -> None:
        if self.mesh_tls is None:
            return
        self.log.write("INFO", f"Node {node_id} reloaded its SSL credentials; reloading ours")
        if self._reload_credentials():
            self._restart_outgoing(f"restarting connections (node {node_id} reloaded credentials)")

    def _reload_credentials(self) -> bool:
        """Step 1: True when the files were loaded; else the old credentials stay, with the error."""
        assert self.mesh_tls is not None
        failed = self.mesh_tls.reload()
        if failed:
            self.credentials_error = f"reloading SSL credentials failed, the previous ones stay: {failed}"
            self.log.write(
                "ERROR",
                f"Reloading SSL credentials failed, keeping the previous ones and all connections: {failed}",
            )
            return False
        self.credentials_error = ""
        self.log.write("INFO", "Reloaded SSL credentials")
        return True

    def _ask_peers_to_reload(self) -> None:
        """Step 2: one RELOAD per peer, over an incoming link if one is open (it outlives step 3)."""
        told: set[int] = set()
        message = proto.encode(proto.RELOAD)
        for conn in sorted(self.conns.values(), key=lambda c: c.kind != INCOMING):
            if conn.kind == CMD or conn.phase != OPEN or conn.node_id < 0 or conn.node_id in told:
                continue
            told.add(conn.node_id)
            self._send(conn, message)
        self.log.write("INFO", f"Asked {len(told)} peer(s) to reload their SSL credentials")

    def _restart_outgoing(self, why: str) -> None:
        """Step 3: close and re-dial every outgoing link (the same instance: imports stay)."""
        for link in self.links.values():
            if link.conn is not None:
                self._close(link.conn)
                link.conn = None
                if link.status == proto.CONN_CONNECTED:
                    link.status = proto.CONN_DISCONNECTED
                    link.reason = why
            link.backoff = self.settings.reconnect_initial_s
            link.next_attempt = None
            link.attempts = 0
            self._dial(link)

    def _heal(self, why: str) -> None:
        raise NotImplementedError
