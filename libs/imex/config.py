"""Rendering and parsing of nvidia-imex configuration files (pure functions).

Two files configure an IMEX daemon:

* ``config.cfg``: ``KEY=VALUE`` lines with the keys nvidia-imex reads (names and defaults as in
  NVIDIA's IMEX guide and the upstream ComputeDomain daemon template). Lines starting with ``#``
  are comments to nvidia-imex.
* the nodes config (``IMEX_NODE_CONFIG_FILE``): one entry per line, a host name or a literal IP
  address; a node's ID in the IMEX domain is its line number (0-based), so every member must get
  the identical file. ComputeDomains write fixed slot names (``libs.imex.slots``) resolved
  through a hosts file.

Both files are read once, at daemon start. The simulator reads its extras from *comment*
directives, ``# SIM_X=value``, which nvidia-imex ignores like any comment, so the very same file
starts either the real daemon or the simulator: ``# SIM_HOSTS_FILE`` is the hosts(5) file the
simulator resolves names through (the real daemon uses the system resolver, i.e. /etc/hosts),
``# SIM_DOMAIN_ID`` an extra identity check in its handshake, and the ``*_S`` directives tune
timing for tests (heartbeats, reconnect backoff, SIGUSR1 throttle).

This module is imported by the simulated daemon at start-up, so it imports nothing at run time
(start-up time is a product target: many daemons start at once).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Keys read by nvidia-imex (exact spelling matters).
LOG_LEVEL = "LOG_LEVEL"
LOG_FILE_NAME = "LOG_FILE_NAME"
STATS_FILE_NAME = "STATS_FILE_NAME"
LOG_APPEND_TO_LOG = "LOG_APPEND_TO_LOG"
LOG_FILE_MAX_SIZE = "LOG_FILE_MAX_SIZE"
LOG_MAX_ROTATE_COUNT = "LOG_MAX_ROTATE_COUNT"
LOG_USE_SYSLOG = "LOG_USE_SYSLOG"
DAEMONIZE = "DAEMONIZE"
BIND_INTERFACE_IP = "BIND_INTERFACE_IP"
SERVER_PORT = "SERVER_PORT"
IMEX_NODE_CONFIG_FILE = "IMEX_NODE_CONFIG_FILE"
NETWORK_INTERFACE = "NETWORK_INTERFACE"
IMEX_WAIT_FOR_QUORUM = "IMEX_WAIT_FOR_QUORUM"
IMEX_ENABLE_AUTH_ENCRYPTION = "IMEX_ENABLE_AUTH_ENCRYPTION"
IMEX_AUTH_ENCRYPTION_MODE = "IMEX_AUTH_ENCRYPTION_MODE"
IMEX_AUTH_SOURCE = "IMEX_AUTH_SOURCE"
IMEX_SERVER_KEY = "IMEX_SERVER_KEY"
IMEX_SERVER_CERT = "IMEX_SERVER_CERT"
IMEX_SERVER_CERT_AUTH = "IMEX_SERVER_CERT_AUTH"
IMEX_CLIENT_KEY = "IMEX_CLIENT_KEY"
IMEX_CLIENT_CERT = "IMEX_CLIENT_CERT"
IMEX_CLIENT_CERT_AUTH = "IMEX_CLIENT_CERT_AUTH"
IMEX_SECURITY_TARGET_OVERRIDE = "IMEX_SECURITY_TARGET_OVERRIDE"
AUTH_MODE_SSL_TLS = "SSL_TLS"
AUTH_SOURCE_FILE = "FILE"
IMEX_CMD_ENABLED = "IMEX_CMD_ENABLED"
IMEX_CMD_BIND_INTERFACE_IP = "IMEX_CMD_BIND_INTERFACE_IP"
IMEX_CMD_PORT = "IMEX_CMD_PORT"
IMEX_CMD_UNIX_DOMAIN_PATH = "IMEX_CMD_UNIX_DOMAIN_PATH"
IMEX_NODE_DISCONNECTED_GRACE_TIME = "IMEX_NODE_DISCONNECTED_GRACE_TIME"

# Simulator-only directives, rendered as comment lines ("# SIM_X=value").
SIM_PREFIX = "SIM_"
SIM_DOMAIN_ID = "SIM_DOMAIN_ID"
SIM_NODE_NAME = "SIM_NODE_NAME"
SIM_HOSTS_FILE = "SIM_HOSTS_FILE"
SIM_RECONNECT_INITIAL_S = "SIM_RECONNECT_INITIAL_S"
SIM_HEARTBEAT_INTERVAL_S = "SIM_HEARTBEAT_INTERVAL_S"
SIM_RECONNECT_MAX_S = "SIM_RECONNECT_MAX_S"
SIM_SIGUSR1_MIN_INTERVAL_S = "SIM_SIGUSR1_MIN_INTERVAL_S"
# The node's driver version (NVML), which nvidia-imex reads from the loaded driver itself.
SIM_DRIVER_VERSION = "SIM_DRIVER_VERSION"

DEFAULT_SERVER_PORT = 50000
DEFAULT_CMD_PORT = 50005
DEFAULT_NODES_CONFIG_FILE = "/etc/nvidia-imex/nodes_config.cfg"
QUORUM_NONE = "NONE"
QUORUM_RECOVERY = "RECOVERY"
WAIT_FOR_QUORUM_VALUES = (QUORUM_NONE, QUORUM_RECOVERY)

# Keys the caller may not override: the supervisor depends on them (where the daemon listens,
# where its peers are, that it stays in the foreground, that its command service is reachable).
MANAGED_KEYS = frozenset(
    {
        BIND_INTERFACE_IP,
        SERVER_PORT,
        IMEX_NODE_CONFIG_FILE,
        IMEX_CMD_ENABLED,
        IMEX_CMD_BIND_INTERFACE_IP,
        IMEX_CMD_PORT,
        DAEMONIZE,
        IMEX_ENABLE_AUTH_ENCRYPTION,
        IMEX_AUTH_ENCRYPTION_MODE,
        IMEX_AUTH_SOURCE,
        IMEX_SERVER_KEY,
        IMEX_SERVER_CERT,
        IMEX_SERVER_CERT_AUTH,
        IMEX_CLIENT_KEY,
        IMEX_CLIENT_CERT,
        IMEX_CLIENT_CERT_AUTH,
        IMEX_SECURITY_TARGET_OVERRIDE,
    }
)


class MeshTlsFiles:
    """The daemon's mesh credentials (absolute paths); one set serves as server and client.
    (A plain class: this module imports nothing at run time.)"""

    __slots__ = ("ca", "cert", "key")

    def __init__(self, key: str, cert: str, ca: str) -> None:
        self.key = key
        self.cert = cert
        self.ca = ca

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshTlsFiles) and (self.key, self.cert, self.ca) == (
            other.key,
            other.cert,
            other.ca,
        )

    def __hash__(self) -> int:
        return hash((self.key, self.cert, self.ca))


def _mesh_tls_entries(mesh_tls: MeshTlsFiles | None) -> list[tuple[str, str]]:
    if mesh_tls is None:
        return [(IMEX_ENABLE_AUTH_ENCRYPTION, "0")]
    for name, path in (("key", mesh_tls.key), ("cert", mesh_tls.cert), ("ca", mesh_tls.ca)):
        _check_line_value(f"mesh TLS {name} file", path)
        if not path:
            raise ValueError(f"mesh TLS {name} file must not be empty")
    return [
        (IMEX_ENABLE_AUTH_ENCRYPTION, "1"),
        (IMEX_AUTH_ENCRYPTION_MODE, AUTH_MODE_SSL_TLS),
        (IMEX_AUTH_SOURCE, AUTH_SOURCE_FILE),
        (IMEX_SERVER_KEY, mesh_tls.key),
        (IMEX_SERVER_CERT, mesh_tls.cert),
        (IMEX_SERVER_CERT_AUTH, mesh_tls.ca),
        (IMEX_CLIENT_KEY, mesh_tls.key),
        (IMEX_CLIENT_CERT, mesh_tls.cert),
        (IMEX_CLIENT_CERT_AUTH, mesh_tls.ca),
    ]


_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def render_imex_config(
    *,
    bind_interface_ip: str,
    nodes_config_file: str,
    cmd_bind_interface_ip: str,
    log_file_name: str,
    domain_id: str,
    node_name: str = "",
    server_port: int = DEFAULT_SERVER_PORT,
    cmd_port: int = DEFAULT_CMD_PORT,
    wait_for_quorum: str = QUORUM_RECOVERY,
    log_level: int = 4,
    log_append_to_log: bool = True,
    log_file_max_size_mb: int = 1024,
    log_max_rotate_count: int = 3,
    node_disconnected_grace_time_s: int = -1,
    hosts_file: str = "",
    heartbeat_interval_s: float | None = None,
    reconnect_initial_s: float | None = None,
    reconnect_max_s: float | None = None,
    sigusr1_min_interval_s: float | None = None,
    driver_version: str = "",
    mesh_tls: MeshTlsFiles | None = None,
    overrides: Mapping[str, str] | None = None,
) -> str:
    """Return the text of a ``config.cfg`` for one node's IMEX daemon.

    ``bind_interface_ip`` is the node's IMEX address (the daemon listens on it at
    ``server_port``); ``cmd_bind_interface_ip``/``cmd_port`` is where ``nvidia-imex-ctl`` finds
    the daemon. ``domain_id``, ``node_name`` and ``hosts_file`` (absolute path of the hosts file
    the simulator resolves the nodes config's names through; empty: only literal IPs resolve)
    and ``driver_version`` (the node's, which the real daemon reads from its driver) become
    simulator comment directives. The
    ``*_s`` simulator settings are rendered only when given. ``overrides`` sets further real
    keys (or replaces rendered ones), except the keys in ``MANAGED_KEYS``. Raises ValueError on
    a value that would corrupt the file (newline, bad port, unknown quorum mode, ...).
    """
    if wait_for_quorum not in WAIT_FOR_QUORUM_VALUES:
        raise ValueError(
            f"IMEX_WAIT_FOR_QUORUM must be one of {WAIT_FOR_QUORUM_VALUES}, got {wait_for_quorum!r}"
        )
    if not 0 <= log_level <= 4:
        raise ValueError(f"LOG_LEVEL must be in 0..4, got {log_level}")
    for name, port in (("SERVER_PORT", server_port), ("IMEX_CMD_PORT", cmd_port)):
        if not 0 <= port <= 65535:
            raise ValueError(f"{name} must be in 0..65535, got {port}")
    _check_token("BIND_INTERFACE_IP", bind_interface_ip, allow_empty=False)
    _check_token("IMEX_CMD_BIND_INTERFACE_IP", cmd_bind_interface_ip, allow_empty=True)
    _check_token("SIM_DOMAIN_ID", domain_id, allow_empty=True)
    _check_token("SIM_NODE_NAME", node_name, allow_empty=True)
    _check_line_value("IMEX_NODE_CONFIG_FILE", nodes_config_file)
    _check_line_value("LOG_FILE_NAME", log_file_name)
    _check_token("SIM_HOSTS_FILE", hosts_file, allow_empty=True)
    _check_token("SIM_DRIVER_VERSION", driver_version, allow_empty=True)
    if not nodes_config_file:
        raise ValueError("IMEX_NODE_CONFIG_FILE must not be empty")

    sections: list[tuple[str, list[tuple[str, str]]]] = [
        (
            "Logging: level 0 (off) .. 4 (info); an empty LOG_FILE_NAME logs to stderr.",
            [
                (LOG_LEVEL, str(log_level)),
                (LOG_FILE_NAME, log_file_name),
                (STATS_FILE_NAME, log_file_name),
                (LOG_APPEND_TO_LOG, _flag(log_append_to_log)),
                (LOG_FILE_MAX_SIZE, str(log_file_max_size_mb)),
                (LOG_MAX_ROTATE_COUNT, str(log_max_rotate_count)),
                (LOG_USE_SYSLOG, "0"),
            ],
        ),
        (
            "Stay in the foreground: the node agent supervises the process.",
            [(DAEMONIZE, "0")],
        ),
        (
            "Peer communication: listen address/port and the list of peers (index = line).",
            [
                (BIND_INTERFACE_IP, bind_interface_ip),
                (SERVER_PORT, str(server_port)),
                (IMEX_NODE_CONFIG_FILE, nodes_config_file),
                (NETWORK_INTERFACE, ""),
                (IMEX_WAIT_FOR_QUORUM, wait_for_quorum),
                (IMEX_NODE_DISCONNECTED_GRACE_TIME, str(node_disconnected_grace_time_s)),
            ],
        ),
        (
            "Mutual TLS between the domain's daemons (credentials from the domain's own CA; "
            "SIGUSR1 reloads them).",
            _mesh_tls_entries(mesh_tls),
        ),
        (
            "Command service queried by nvidia-imex-ctl (-q, -N).",
            [
                (IMEX_CMD_ENABLED, "1"),
                (IMEX_CMD_BIND_INTERFACE_IP, cmd_bind_interface_ip),
                (IMEX_CMD_PORT, str(cmd_port)),
                (IMEX_CMD_UNIX_DOMAIN_PATH, ""),
            ],
        ),
    ]

    extra: list[tuple[str, str]] = []
    if overrides:
        rendered_keys = {key for _, entries in sections for key, _ in entries}
        replaced: dict[str, str] = {}
        for key, value in overrides.items():
            _check_override(key, value)
            if key in rendered_keys:
                replaced[key] = value
            else:
                extra.append((key, value))
        sections = [
            (comment, [(key, replaced.get(key, value)) for key, value in entries])
            for comment, entries in sections
        ]
    if extra:
        sections.append(("Additional settings.", extra))

    directives: list[tuple[str, str]] = [(SIM_DOMAIN_ID, domain_id)]
    if node_name:
        directives.append((SIM_NODE_NAME, node_name))
    if hosts_file:
        directives.append((SIM_HOSTS_FILE, hosts_file))
    if driver_version:
        directives.append((SIM_DRIVER_VERSION, driver_version))
    for key, seconds in (
        (SIM_HEARTBEAT_INTERVAL_S, heartbeat_interval_s),
        (SIM_RECONNECT_INITIAL_S, reconnect_initial_s),
        (SIM_RECONNECT_MAX_S, reconnect_max_s),
        (SIM_SIGUSR1_MIN_INTERVAL_S, sigusr1_min_interval_s),
    ):
        if seconds is not None:
            if not seconds >= 0:  # also rejects NaN
                raise ValueError(f"{key} must be >= 0, got {seconds}")
            directives.append((key, repr(float(seconds))))

    lines = [
        "# nvidia-imex configuration rendered by the ComputeDomain node agent.",
        "# It and the nodes config are read once, at daemon start; SIGUSR1 re-resolves the",
        "# nodes config's names and reconnects to every peer.",
        "",
    ]
    for comment, entries in sections:
        lines.append(f"# {comment}")
        lines.extend(f"{key}={value}" for key, value in entries)
        lines.append("")
    lines.append("# Simulator directives (comments to nvidia-imex, read by the IMEX simulator only).")
    lines.extend(f"# {key}={value}" for key, value in directives)
    return "\n".join(lines) + "\n"


def parse_imex_config(text: str) -> dict[str, str]:
    """Parse ``config.cfg`` text into ``{KEY: value}`` (values stripped, last one wins).

    Comment lines are skipped, except simulator directives ``# SIM_X=value`` which appear under
    their ``SIM_X`` key. Lines without ``=`` are ignored, as nvidia-imex does.
    """
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            line = line[1:].strip()
            if not line.startswith(SIM_PREFIX):
                continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key:
            values[key] = value.strip()
    return values


def render_nodes_config(addresses: Sequence[str]) -> str:
    """Return the nodes config text: one entry (host name or address) per line, in ID order.

    Every member of a domain must receive the identical text, so the caller passes the entries
    ordered by index. Raises ValueError on an empty, malformed or repeated entry.
    """
    seen: set[str] = set()
    for address in addresses:
        _check_token("address", address, allow_empty=False)
        if address.lower() in seen:  # host names are case-insensitive
            raise ValueError(f"address {address!r} listed twice in the nodes config")
        seen.add(address.lower())
    return "".join(f"{address}\n" for address in addresses)


def parse_nodes_config(text: str) -> list[str]:
    """Return the entries (names or addresses) of a nodes config in order (blank lines and #
    comments skipped)."""
    addresses: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            addresses.append(line)
    return addresses


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _check_line_value(name: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise ValueError(f"{name} must not contain a line break: {value!r}")
    if value != value.strip():
        raise ValueError(f"{name} must not start or end with whitespace: {value!r}")


def _check_token(name: str, value: str, *, allow_empty: bool) -> None:
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if any(ch.isspace() for ch in value) or "#" in value or "=" in value:
        raise ValueError(f"{name} must be a single token without whitespace, '#' or '=': {value!r}")


def _check_override(key: str, value: str) -> None:
    if not key or not set(key) <= _KEY_CHARS or key[0].isdigit():
        raise ValueError(f"invalid IMEX config key {key!r}")
    if key in MANAGED_KEYS:
        raise ValueError(f"IMEX config key {key} is managed by the node agent and cannot be overridden")
    if key.startswith(SIM_PREFIX):
        raise ValueError(f"IMEX config key {key} uses the reserved simulator prefix {SIM_PREFIX}")
    _check_line_value(key, value)
