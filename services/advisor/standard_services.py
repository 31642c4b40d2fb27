"""The standard gRPC services next to the PlacementAdvisor: health checking and server reflection.

`grpc.health.v1.Health` answers SERVING for the advisor (and for the empty, whole-server name)
once its inventory has listed the store, NOT_SERVING before: the same readiness as `/readyz`, in
the form gRPC clients, load balancers and Kubernetes' gRPC probes understand. Server reflection
(`grpc.reflection.v1` and `v1alpha`) lets grpcurl and reflection clients list and describe the
API without the .proto files; the descriptors come from `libs/gen/descriptors.py`, generated from
`protos/` with the Python code.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import descriptor_pb2, descriptor_pool
from grpclib._typing import IServable
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health
from grpclib.reflection.service import ServerReflection

from libs.gen.descriptors import FILE_DESCRIPTOR_SET


def register_descriptors(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add our protos' file descriptors to `pool` (default: protobuf's default pool). Idempotent.

    Files already in the pool (the well-known types, or ours from an earlier call) are left alone.
    """
    pool = pool or descriptor_pool.Default()
    files = descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET)
    for file in files.file:
        try:
            pool.FindFileByName(file.name)
        except KeyError:
            pool.Add(file)


def standard_services(served: Sequence[IServable], ready: ServiceStatus) -> list[IServable]:
    """`served` plus Health (each served service, and the whole server, follow `ready`) and
    server reflection over all of them."""
    register_descriptors()
    health = Health({OVERALL: [ready], **{service: [ready] for service in served}})
    return ServerReflection.extend([*served, health])
