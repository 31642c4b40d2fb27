"""The records the simulation's claim source reads: a claim as the scheduler would have allocated
it, and the ComputeDomain a user would have created (pure builders).

In Kubernetes mode these are a ResourceClaim and a ComputeDomain object; without Kubernetes
(cdsim, the chaos soak, the benchmarks) the same facts are written to the store, and the kubelet
plugin's store claim source (``services/nodeagent/wire/claim_source.py``) reads them back.
"""

from __future__ import annotations

from libs.cdi.spec import ALLOCATION_ALL, ALLOCATION_SINGLE
from libs.contract.channel_config import channel_config_json
from libs.contract.names import CHANNEL_DEVICE, CHANNEL_REQUEST, DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb

SIMULATION_SOURCE = "simulation"


def store_claim(
    *,
    uid: str,
    namespace: str,
    name: str,
    node: str,
    domain_uid: str,
    allocation_mode: str = ALLOCATION_SINGLE,
    created_unix_ms: int = 0,
) -> pb.Claim:
    """A claim allocated ``channel-0`` of `node`'s pool, configured for `domain_uid`."""
    return pb.Claim(
        uid=uid,
        namespace=namespace,
        name=name,
        results=[
            pb.AllocationResult(request=CHANNEL_REQUEST, driver=DRIVER_NAME, pool=node, device=CHANNEL_DEVICE)
        ],
        config=[
            pb.OpaqueConfig(
                requests=[CHANNEL_REQUEST],
                driver=DRIVER_NAME,
                parameters_json=channel_config_json(domain_uid, allocation_mode),
                source="FromClaim",
            )
        ],
        node_name=node,
        created_unix_ms=created_unix_ms,
    )


def store_domain(
    *,
    uid: str,
    namespace: str,
    name: str,
    num_nodes: int,
    allocation_mode: str = ALLOCATION_SINGLE,
    created_unix_ms: int = 0,
) -> pb.ComputeDomain:
    """A ComputeDomain as a user creates it (status NotReady; the controller decides the rest)."""
    mode = pb.AllocationMode.ALL if allocation_mode == ALLOCATION_ALL else pb.AllocationMode.SINGLE
    return pb.ComputeDomain(
        uid=uid,
        namespace=namespace,
        name=name,
        spec=pb.ComputeDomainSpec(
            num_nodes=num_nodes,
            channel=pb.ChannelSpec(resource_claim_template_name=f"{name}-channel", allocation_mode=mode),
        ),
        status=pb.ComputeDomainStatus(status=pb.Readiness.NOT_READY),
        created_unix_ms=created_unix_ms,
        source=SIMULATION_SOURCE,
    )
