"""The directory of one domain's daemon on this node, and what goes in it.

``<work dir>/<domain uid>/``:

* ``config.cfg``: the daemon's configuration (libs/imex/config.py) with the simulator directive
  ``# SIM_HOSTS_FILE=<hosts>`` (a comment to nvidia-imex; the real daemon resolves through the
  system resolver). Every daemon, simulated or not, is started in a private mount namespace
  with this file bind-mounted over /etc/hosts (libs/imex/hosts_ns.py), where its ctl runs too;
* ``nodes_config.cfg``: the 18 slot names of the domain's clique, written once before the first
  start and never while a daemon runs on it (a daemon reads it only at start);
* ``hosts``: slot name -> address of its member (or the placeholder), replaced atomically when
  an address changes;
* ``daemon.pid`` and ``nvidia-imex.log``.

Rendering is pure; the writes are blocking (fsynced) and are called from worker threads.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from libs.fsio.atomic import write_atomic
from libs.imex import config as imexcfg
from libs.imex import slots
from services.imexagent.mesh_creds import mesh_files
from services.imexagent.settings import ImexSettings
from services.imexagent.slot_map import DesiredDaemon, Identity

CONFIG_FILE = "config.cfg"
NODES_CONFIG_FILE = "nodes_config.cfg"
HOSTS_FILE = "hosts"
LOG_FILE = "nvidia-imex.log"

_DOMAIN_DIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def domain_dirs(work_dir: Path) -> list[Path]:
    """Per-domain directories that exist under the work directory."""
    try:
        return sorted(p for p in work_dir.iterdir() if p.is_dir() and _DOMAIN_DIR_NAME.fullmatch(p.name))
    except FileNotFoundError:
        return []


class DomainDir:
    """Paths and contents of one domain's directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def uid(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def nodes_config(self) -> Path:
        return self.path / NODES_CONFIG_FILE

    @property
    def hosts(self) -> Path:
        return self.path / HOSTS_FILE

    @property
    def log(self) -> Path:
        return self.path / LOG_FILE

    # ---- rendering (pure) ---------------------------------------------------------------

    def render_config(
        self,
        identity: Identity,
        node_name: str,
        settings: ImexSettings,
        mesh_tls: imexcfg.MeshTlsFiles | None = None,
    ) -> str:
        return imexcfg.render_imex_config(
            bind_interface_ip=identity.address,
            nodes_config_file=str(self.nodes_config),
            cmd_bind_interface_ip=settings.cmd_bind_ip or identity.address,
            log_file_name=str(self.log),
            domain_id=identity.domain_uid,
            node_name=node_name,
            server_port=settings.server_port,
            cmd_port=settings.cmd_port,
            wait_for_quorum=settings.wait_for_quorum,
            node_disconnected_grace_time_s=settings.disconnected_grace_s,
            log_file_max_size_mb=settings.log_file_max_size_mb,
            hosts_file=str(self.hosts),
            heartbeat_interval_s=settings.sim_heartbeat_interval_s,
            reconnect_initial_s=settings.sim_reconnect_initial_s,
            reconnect_max_s=settings.sim_reconnect_max_s,
            sigusr1_min_interval_s=settings.sim_sigusr1_min_interval_s,
            mesh_tls=mesh_tls,
            driver_version=settings.node_driver_version,
        )

    @staticmethod
    def render_nodes_config(identity: Identity) -> str:
        return slots.render_nodes_config_slots(identity.domain_uid, identity.clique_id)

    @staticmethod
    def render_hosts(desired: DesiredDaemon) -> str:
        return slots.render_hosts(desired.slot_addresses, desired.domain_uid, desired.clique_id)

    # ---- files (blocking) ---------------------------------------------------------------

    def read(self, path: Path) -> str | None:
        try:
            return path.read_text()
        except OSError:
            return None

    def prepare_start(
        self, desired: DesiredDaemon, settings: ImexSettings, mesh_tls: imexcfg.MeshTlsFiles | None = None
    ) -> str:
        """Write what a daemon about to start reads (no daemon runs here now); returns the hosts
        text written. Files already right are left alone.

        Atomic (a daemon never reads half a file) but not fsynced: a crash of the agent keeps
        them (the page cache outlives a process), and a crash of the machine takes the daemon
        with it, after which every file is written again before the next start. An fsync here
        only delayed each start by a disk flush."""
        self.path.mkdir(parents=True, exist_ok=True)
        wanted = (
            (self.config, self.render_config(desired.identity, desired.node_name, settings, mesh_tls)),
            (self.nodes_config, self.render_nodes_config(desired.identity)),
            (self.hosts, self.render_hosts(desired)),
        )
        for path, text in wanted:
            if self.read(path) != text:
                write_atomic(path, text.encode(), durable=False)
        return wanted[2][1]

    def write_hosts(self, text: str, *, in_place: bool = False) -> None:
        """Replace the slot resolution. ``in_place`` rewrites the same inode (one write of the
        whole text after truncation): nvidia-imex sees this file through a bind mount over
        /etc/hosts, which pins the inode, so a rename would hide the change from it. A lookup
        racing the rewrite may fail once; the daemon's reconnect loop looks again."""
        if not in_place:
            write_atomic(self.hosts, text.encode(), durable=False)  # see prepare_start
            return
        fd = os.open(self.hosts, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            data = text.encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def serves(self, identity: Identity, node_name: str, settings: ImexSettings) -> bool:
        """Whether a daemon started on this directory's files has this identity (adoption), in
        either mesh mode (a domain's mode never changes)."""
        config = self.read(self.config)
        rendered = [
            _without_driver_directive(self.render_config(identity, node_name, settings, mesh))
            for mesh in (None, mesh_files(self.path))
        ]
        return (
            config is not None
            and _without_driver_directive(config) in rendered
            and self.read(self.nodes_config) == self.render_nodes_config(identity)
        )

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _without_driver_directive(config: str) -> str:
    """A config without its driver version directive: a daemon started by an agent that did not
    render it (or before a driver change, which restarts the node) is still this domain's."""
    marker = f"# {imexcfg.SIM_DRIVER_VERSION}="
    return "".join(line for line in config.splitlines(keepends=True) if not line.startswith(marker))
