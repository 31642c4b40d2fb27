"""What an IMEX daemon reports through nvidia-imex-ctl: its states and its links' statuses.

Part of the IMEX daemon port (libs/imex/daemon_port.py): the real nvidia-imex prints these words,
the simulator (tools/sim/imex) reports the same ones, and the IMEX agent reads them. Kept apart
from the port and free of imports because the simulated daemon imports it at start-up.
"""

# Daemon states, as printed by `nvidia-imex-ctl -q` (names from NVIDIA's documented set).
STATE_INITIALIZING = "INITIALIZING"
STATE_WAITING_FOR_PEERS = "WAITING_FOR_PEERS"
# After an unclean stop, until the nodes that imported its memory reconnected.
STATE_WAITING_FOR_RECOVERY = "WAITING_FOR_RECOVERY"
STATE_READY = "READY"
STATE_SHUTTING_DOWN = "SHUTTING_DOWN"
STATE_UNAVAILABLE = "UNAVAILABLE"  # printed by ctl when the daemon cannot be reached

# Connection statuses, named after the legend of `nvidia-imex-ctl -N`.
CONN_CONNECTED = "CONNECTED"  # C
CONN_INVALID = "INVALID"  # I: no status available (node not reachable)
CONN_NEVER_CONNECTED = "NEVER_CONNECTED"  # N
CONN_DISCONNECTED = "DISCONNECTED"  # D
CONN_NODE_MAP_MISMATCH = "NODE_MAP_MISMATCH"  # !M!: peer belongs to another domain
