"""The fixed slot names of an IMEX domain and their name resolution (pure functions).

nvidia-imex reads its nodes config once, at start, and fixes its own node ID then: the line
whose address is its own. A nodes config listing member addresses would have to change whenever
a member joins or leaves, which a running daemon never sees (and a restart kills the job's
imports). So every domain-and-clique gets one nodes config of ``MAX_SLOTS`` fixed *names*, written
once; slot i's name resolves (through a hosts file) to the member holding index i, or to
``PLACEHOLDER_ADDRESS`` while no member holds it. Membership changes only rewrite the resolution.

The names embed the domain uid and a digest of the clique id, so two domains (or two cliques of
one domain) never share a node map: daemons whose maps differ refuse each other, which keeps a
reused address from joining the wrong mesh (upstream #1447). They end in ``.invalid``, a name that
DNS never resolves, so only the hosts file can.

Imported by the simulated daemon at start-up: only cheap imports here.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

try:  # hashlib loads OpenSSL (3-4 ms of every daemon start); its fallback module is the same hash
    from _sha256 import sha256 as _sha256  # CPython 3.11
except ImportError:  # pragma: no cover - other interpreters and versions
    try:
        from _sha2 import sha256 as _sha256  # CPython 3.12+
    except ImportError:
        from hashlib import sha256 as _sha256

_hash: Callable[[bytes], str] = lambda data: _sha256(data).hexdigest()  # noqa: E731

MAX_SLOTS = 18  # maxNodesPerImexDomain
# A loopback address no simulated node uses and nothing listens on: a peer dialling an empty slot
# is refused at once and keeps retrying, which harms nobody (upstream #1465 uses a sentinel too).
PLACEHOLDER_ADDRESS = "127.255.255.254"
_SUFFIX = "imex.invalid"


def clique_tag(clique_id: str) -> str:
    """A DNS-label-safe digest of a clique id (clique ids contain dots and may be long)."""
    return _hash(clique_id.encode())[:10]


def slot_name(domain_uid: str, clique_id: str, index: int) -> str:
    """The host name of slot `index` of the domain's clique."""
    if not 0 <= index < MAX_SLOTS:
        raise ValueError(f"slot index must be in [0, {MAX_SLOTS}), got {index}")
    if not domain_uid or not _is_label(domain_uid):
        raise ValueError(f"domain uid {domain_uid!r} cannot be part of a host name")
    return f"s{index}.{clique_tag(clique_id)}.{domain_uid.lower()}.{_SUFFIX}"


# Rendered on every hosts check of every daemon: 18 digests each time showed in profiles. A plain
# dict, not functools.lru_cache: functools costs the daemon's start-up 3 ms.
_SLOT_NAMES: dict[tuple[str, str], tuple[str, ...]] = {}
_SLOT_NAMES_MAX = 1024


def slot_names(domain_uid: str, clique_id: str) -> list[str]:
    key = (domain_uid, clique_id)
    names = _SLOT_NAMES.get(key)
    if names is None:
        names = tuple(slot_name(domain_uid, clique_id, i) for i in range(MAX_SLOTS))
        if len(_SLOT_NAMES) >= _SLOT_NAMES_MAX:
            _SLOT_NAMES.clear()
        _SLOT_NAMES[key] = names
    return list(names)


def render_nodes_config_slots(domain_uid: str, clique_id: str) -> str:
    """The nodes config of the domain's clique: the slot names, one per line, in index order."""
    return "".join(f"{name}\n" for name in slot_names(domain_uid, clique_id))


def render_hosts(slot_addresses: Sequence[str], domain_uid: str, clique_id: str) -> str:
    """A hosts(5) file mapping slot i to ``slot_addresses[i]`` (``MAX_SLOTS`` entries)."""
    if len(slot_addresses) != MAX_SLOTS:
        raise ValueError(f"need {MAX_SLOTS} slot addresses, got {len(slot_addresses)}")
    lines = ["# IMEX slot names of one ComputeDomain clique (written by the IMEX agent)."]
    for name, address in zip(slot_names(domain_uid, clique_id), slot_addresses, strict=True):
        if not address or any(ch.isspace() for ch in address) or "#" in address:
            raise ValueError(f"invalid address {address!r} for {name}")
        lines.append(f"{address} {name}")
    return "\n".join(lines) + "\n"


def parse_hosts(text: str) -> dict[str, str]:
    """Host name -> address from hosts(5) text; the first line naming a host wins, as in libc."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        fields = raw.partition("#")[0].split()
        if len(fields) < 2:
            continue
        for name in fields[1:]:
            out.setdefault(name.lower(), fields[0])
    return out


def nodes_map_digest(names: Sequence[str]) -> str:
    """What two daemons compare to know they run on the same node map."""
    return _hash("\n".join(names).encode())[:16]


def _is_label(text: str) -> bool:
    return all(ch.isalnum() or ch == "-" for ch in text) and len(text) <= 63 and not text.startswith("-")
