"""Moved to ``services.imexagent.inventory`` (the node record lives on the IMEX agent's lease).

A re-export for the modules of the kubelet plugin that still import it from here.
"""

from services.imexagent.inventory import (
    AGENT_VERSION,
    InventorySettings,
    NodeInventory,
    build_node_record,
    clique_settled,
    node_address,
)

__all__ = [
    "AGENT_VERSION",
    "InventorySettings",
    "NodeInventory",
    "build_node_record",
    "clique_settled",
    "node_address",
]
