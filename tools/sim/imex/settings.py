"""What the simulated daemon takes from config.cfg, with nvidia-imex's defaults (cheap to import)."""

from __future__ import annotations

import os

from libs.imex import config as keys
from libs.imex.driver import SIMULATED_DRIVER_VERSION
from tools.sim.imex.recovery import PERSIST_FILE

DEFAULT_LOG_FILE = "/var/log/nvidia-imex.log"
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
# nvidia-imex's reconnect loop: 0.5 s, doubling, at most 3 s (kubernetes-sigs/dra-driver-nvidia-gpu#1443).
DEFAULT_RECONNECT_INITIAL_S = 0.5
DEFAULT_RECONNECT_MAX_S = 3.0
# nvidia-imex ignores a SIGUSR1 within 5 s of the last one (IMEX_MINIMUM_SSL_RELOAD_INTERVAL).
DEFAULT_SIGUSR1_MIN_INTERVAL_S = 5.0
# IMEX_NODE_DISCONNECTED_GRACE_TIME: -1 waits for a lost peer forever (nvidia-imex's default), 0
# cleans up at once, N > 0 after N seconds.
GRACE_FOREVER = -1


class ConfigError(Exception):
    """The configuration cannot be used; the daemon exits with status 1."""


class Settings:
    """The values the simulator uses from config.cfg."""

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
        if self.wait_for_quorum not in keys.WAIT_FOR_QUORUM_VALUES:
            raise ConfigError(
                f"{keys.IMEX_WAIT_FOR_QUORUM} must be one of {', '.join(keys.WAIT_FOR_QUORUM_VALUES)}, "
                f"got {self.wait_for_quorum!r}"
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
        self.hosts_file = values.get(keys.SIM_HOSTS_FILE, "")
        self.driver_version = values.get(keys.SIM_DRIVER_VERSION, "") or SIMULATED_DRIVER_VERSION
        # nvidia-imex's /var/run/nvidia-imex/persist.dat; here beside config.cfg (recovery.py).
        self.persist_file = os.path.join(os.path.dirname(os.path.abspath(config_path)), PERSIST_FILE)
        self.heartbeat_s = _seconds(values, keys.SIM_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_INTERVAL_S)
        if self.heartbeat_s <= 0:
            raise ConfigError(f"{keys.SIM_HEARTBEAT_INTERVAL_S} must be > 0")
        self.reconnect_initial_s = _seconds(values, keys.SIM_RECONNECT_INITIAL_S, DEFAULT_RECONNECT_INITIAL_S)
        if self.reconnect_initial_s <= 0:
            raise ConfigError(f"{keys.SIM_RECONNECT_INITIAL_S} must be > 0")
        self.reconnect_max_s = max(
            _seconds(values, keys.SIM_RECONNECT_MAX_S, DEFAULT_RECONNECT_MAX_S), self.reconnect_initial_s
        )
        self.sigusr1_min_interval_s = _seconds(
            values, keys.SIM_SIGUSR1_MIN_INTERVAL_S, DEFAULT_SIGUSR1_MIN_INTERVAL_S
        )
        self.disconnected_grace_s = _grace(values)
        self.mesh_tls = _mesh_tls(values)
        self.security_target_override = values.get(keys.IMEX_SECURITY_TARGET_OVERRIDE, "")


class MeshTlsPaths:
    """Where the daemon's TLS credentials are (files; read at start and at SIGUSR1)."""

    __slots__ = ("client_ca", "client_cert", "client_key", "server_ca", "server_cert", "server_key")

    def __init__(self, files: dict[str, str]) -> None:
        self.server_key = files[keys.IMEX_SERVER_KEY]
        self.server_cert = files[keys.IMEX_SERVER_CERT]
        self.server_ca = files[keys.IMEX_SERVER_CERT_AUTH]
        self.client_key = files[keys.IMEX_CLIENT_KEY]
        self.client_cert = files[keys.IMEX_CLIENT_CERT]
        self.client_ca = files[keys.IMEX_CLIENT_CERT_AUTH]


_TLS_FILE_KEYS = (
    keys.IMEX_SERVER_KEY,
    keys.IMEX_SERVER_CERT,
    keys.IMEX_SERVER_CERT_AUTH,
    keys.IMEX_CLIENT_KEY,
    keys.IMEX_CLIENT_CERT,
    keys.IMEX_CLIENT_CERT_AUTH,
)


def _mesh_tls(values: dict[str, str]) -> MeshTlsPaths | None:
    """The TLS settings, as strictly as nvidia-imex: an empty or unknown mode or source prevents
    initialization."""
    enabled = values.get(keys.IMEX_ENABLE_AUTH_ENCRYPTION, "0") or "0"
    if enabled == "0":
        return None
    if enabled != "1":
        raise ConfigError(f"{keys.IMEX_ENABLE_AUTH_ENCRYPTION} must be 0 or 1, got {enabled!r}")
    mode = values.get(keys.IMEX_AUTH_ENCRYPTION_MODE, "")
    if mode in ("GSS_AUTH_ENCRYPT", "GSS_AUTH_ONLY"):
        raise ConfigError(f"{keys.IMEX_AUTH_ENCRYPTION_MODE}={mode} (GSSAPI) is not simulated; use SSL_TLS")
    if mode != keys.AUTH_MODE_SSL_TLS:
        raise ConfigError(
            f"{keys.IMEX_ENABLE_AUTH_ENCRYPTION}=1 needs {keys.IMEX_AUTH_ENCRYPTION_MODE}=SSL_TLS, got {mode!r}"
        )
    source = values.get(keys.IMEX_AUTH_SOURCE, "")
    if source == "ENV_VAL":
        raise ConfigError(f"{keys.IMEX_AUTH_SOURCE}=ENV_VAL is not simulated; use FILE or ENV_PATH")
    if source not in (keys.AUTH_SOURCE_FILE, "ENV_PATH"):
        raise ConfigError(f"{keys.IMEX_AUTH_SOURCE} must be FILE or ENV_PATH with SSL_TLS, got {source!r}")
    files: dict[str, str] = {}
    for key in _TLS_FILE_KEYS:
        raw = values.get(key, "")
        path = os.environ.get(raw, "") if source == "ENV_PATH" else raw
        if not path:
            where = f"the environment variable {raw!r} named by {key}" if source == "ENV_PATH" else key
            raise ConfigError(f"{where} is empty: SSL_TLS needs every key, certificate and CA file")
        files[key] = path
    return MeshTlsPaths(files)


def _grace(values: dict[str, str]) -> int:
    """IMEX_NODE_DISCONNECTED_GRACE_TIME as nvidia-imex documents it: -1, 0 or seconds > 0."""
    grace = _int(values, keys.IMEX_NODE_DISCONNECTED_GRACE_TIME, GRACE_FOREVER)
    if grace < GRACE_FOREVER:
        raise ConfigError(
            f"{keys.IMEX_NODE_DISCONNECTED_GRACE_TIME} must be -1 (wait forever), 0 or a number of "
            f"seconds, got {grace}"
        )
    return grace


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
