"""Wire format of the simulated IMEX daemon (peer links and command service).

Every message is one line: a verb, then ``key=value`` fields separated by single spaces, then
``\\n``. Values are percent-escaped for ``%``, space, CR and LF, so any text fits. This is a
plain text format on purpose: the daemon avoids importing json/asyncio to start fast.

Peer link (client = the node that dials, server = the node that accepts):

* client -> server ``HELLO domain=<uid> node_id=<client's ID> instance=<client's instance>
  addr=<client address> map=<nodes map digest>``
* server -> client ``WELCOME domain=<uid> node_id=<server's ID> instance=<id> addr=<address>
  map=<digest>`` or ``REFUSE code=<code> reason=<text>`` (then the server closes)
* either side ``PING`` (heartbeat, sent when the link was quiet for one interval), ``BYE``
  (the sender is shutting down: its exports are gone) and ``RELOAD`` (the sender reloaded its TLS
  credentials on SIGUSR1: the receiver reloads its own and restarts its outgoing links).
* client -> server ``IMPORTED job=<name>`` / ``UNIMPORTED job=<name>``: a job on the client
  imported memory the server exported / dropped those imports.

Command service (one request line, the reply, then the daemon closes the connection):

* ``STATUS`` -> ``STATUS state=.. pid=.. instance=.. node_id=.. addr=.. domain=.. version=..
  host=.. map=.. nodes=<name,name,..> dropped=<id,..>`` and per node ID i ``addr.<i>=<resolved
  address> conn.<i>=<connection status> why.<i>=<reason> inst.<i>=<peer instance>``
* ``IMPORT job=<name> node=<id>`` -> ``OK instance=<exporter instance>`` or ``ERR reason=..``
* ``IMPORTS`` -> ``IMPORTS n=<count>`` and per entry k ``job.<k> node.<k> inst.<k> valid.<k>
  (1|0) why.<k>``
* ``UNIMPORT job=<name>`` -> ``OK removed=<count>``
* ``CRASH`` | ``HANG`` | ``DROP node=<id>`` (or ``addr=<address>``) | ``HEAL`` | ``CUT
  seconds=<s>`` -> ``OK`` (or ``ERR reason=..``)

STATUS also carries ``cred_error=<why>`` while the last TLS credential reload failed.
"""

from __future__ import annotations

from libs.imex import daemon_state

# The daemon states and link statuses are the port's, the words nvidia-imex-ctl prints: the
# simulator reports the same ones (WAITING_FOR_RECOVERY: see recovery.py).
STATE_INITIALIZING = daemon_state.STATE_INITIALIZING
STATE_READY = daemon_state.STATE_READY
STATE_SHUTTING_DOWN = daemon_state.STATE_SHUTTING_DOWN
STATE_UNAVAILABLE = daemon_state.STATE_UNAVAILABLE
STATE_WAITING_FOR_PEERS = daemon_state.STATE_WAITING_FOR_PEERS
STATE_WAITING_FOR_RECOVERY = daemon_state.STATE_WAITING_FOR_RECOVERY
CONN_CONNECTED = daemon_state.CONN_CONNECTED
CONN_DISCONNECTED = daemon_state.CONN_DISCONNECTED
CONN_INVALID = daemon_state.CONN_INVALID
CONN_NEVER_CONNECTED = daemon_state.CONN_NEVER_CONNECTED
CONN_NODE_MAP_MISMATCH = daemon_state.CONN_NODE_MAP_MISMATCH

CONN_LEGEND = {
    CONN_CONNECTED: "C",
    CONN_INVALID: "I",
    CONN_NEVER_CONNECTED: "N",
    CONN_DISCONNECTED: "D",
    CONN_NODE_MAP_MISMATCH: "!M!",
}

# Peer link verbs.
HELLO = "HELLO"
WELCOME = "WELCOME"
REFUSE = "REFUSE"
PING = "PING"
BYE = "BYE"
# Importer -> exporter over the importer's outgoing link: a local job imported (or dropped) memory
# of the exporter, which keeps its importers in its persistence file (recovery.py).
IMPORTED = "IMPORTED"
UNIMPORTED = "UNIMPORTED"
RELOAD = "RELOAD"

# Refusal codes.
REFUSE_NODE_MAP_MISMATCH = "node-map-mismatch"  # different nodes config (or SIM_DOMAIN_ID)
REFUSE_INVALID_NODE_ID = "invalid-node-id"  # out of range, or the acceptor's own ID
REFUSE_DROPPED = "dropped"
REFUSE_ADDRESS_MISMATCH = "address-mismatch"  # source address is not what the ID's name resolves to
REFUSE_SHUTTING_DOWN = "shutting-down"
REFUSE_TLS = "tls"  # no TLS, or a certificate not from the domain's CA (closed, no REFUSE sent)
REFUSE_CERTIFICATE_MISMATCH = "certificate-mismatch"  # the certificate names another node's slot

# Command verbs.
CMD_STATUS = "STATUS"
CMD_CRASH = "CRASH"
CMD_HANG = "HANG"
CMD_DROP = "DROP"
CMD_HEAL = "HEAL"
CMD_CUT = "CUT"
CMD_IMPORT = "IMPORT"
CMD_IMPORTS = "IMPORTS"
CMD_UNIMPORT = "UNIMPORT"
REPLY_OK = "OK"
REPLY_ERR = "ERR"

SIM_VERSION = "sim-2"
MAX_LINE = 1 << 16  # longest accepted line; a peer sending more is cut off

_EMPTY = "-"  # stands for an empty value so that fields stay non-empty


def encode(verb: str, fields: dict[str, str] | None = None) -> bytes:
    """Encode one message line (verb and fields) as bytes ending in a newline."""
    parts = [verb]
    if fields:
        for key, value in fields.items():
            parts.append(f"{key}={_escape(value)}")
    return (" ".join(parts) + "\n").encode()


def decode(line: bytes) -> tuple[str, dict[str, str]]:
    """Decode one message line (without or with its newline) into (verb, fields).

    Raises ValueError on a line that is not UTF-8 or has a field without ``=``.
    """
    text = line.decode().rstrip("\r\n")  # only the line end: values may hold any other character
    verb, _, rest = text.partition(" ")
    fields: dict[str, str] = {}
    for part in rest.split(" "):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"malformed field {part!r} in {verb} message")
        fields[key] = _unescape(value)
    return verb, fields


def _escape(value: str) -> str:
    if not value:
        return _EMPTY
    if value == _EMPTY:
        return "%2D"
    return value.replace("%", "%25").replace(" ", "%20").replace("\n", "%0A").replace("\r", "%0D")


def _unescape(value: str) -> str:
    if value == _EMPTY:
        return ""
    if "%" not in value:
        return value
    return (
        value.replace("%20", " ")
        .replace("%0A", "\n")
        .replace("%0D", "\r")
        .replace("%2D", "-")
        .replace("%25", "%")
    )
