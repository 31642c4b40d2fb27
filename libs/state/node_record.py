"""Readings of a node record (``nodes/<node>``) that more than one service makes.

The IMEX agent writes the record (services/imexagent/node_record_keeper.py); the node agent reads it.
"""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb


def clique_settled(node: pb.Node) -> bool:
    """True when the record's clique is final: a fabric clique, or a genuinely non-fabric node.

    While the fabric is PENDING or in ERROR, or the hardware could not be read, the writer leaves
    ``clique_id`` empty and says why in ``fabric_message``.
    """
    return not node.fabric_message
