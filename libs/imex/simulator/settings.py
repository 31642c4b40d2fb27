"""What the simulated daemon takes from config.cfg, with nvidia-imex's defaults (cheap to import)."""

from __future__ import annotations

from libs.imex import config as keys

DEFAULT_LOG_FILE = "/var/log/nvidia-imex.log"
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
# nvidia-imex's reconnect loop: 0.5 s, doubling, at most 3 s (kubernetes-sigs/dra-driver-nvidia-gpu#1443).
DEFAULT_RECONNECT_INITIAL_S = 0.5
DEFAULT_RECONNECT_MAX_S = 3.0
# nvidia-imex ignores a SIGUSR1 within 5 s of the last one (IMEX_MINIMUM_SSL_RELOAD_INTERVAL).
DEFAULT_SIGUSR1_MIN_INTERVAL_S = 5.0


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
