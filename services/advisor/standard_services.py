"""The standard gRPC services next to the PlacementAdvisor: health checking and server reflection.

`grpc.health.v1.Health` answers SERVING for the advisor (and for the empty, whole-server name)
once its fleet index has listed the store, NOT_SERVING before: the same readiness as `/readyz`, in
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
from grpclib.health.v1 import health_pb2
from grpclib.reflection.service import ServerReflection
from grpclib.reflection.v1 import reflection_pb2

from libs.gen.descriptors import FILE_DESCRIPTOR_SET


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool of our protos and the standard services' own files.

    A pool of its own, not protobuf's default one: a process that also loads generated modules of
    the same protos (grpcio stubs of the kubelet API, say) must not meet duplicate symbols.
    """
    pool = descriptor_pool.DescriptorPool()
    for module in (health_pb2, reflection_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    for file in descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET).file:
        pool.Add(file)
    return pool


def standard_services(served: Sequence[IServable], ready: ServiceStatus) -> list[IServable]:
    """`served` plus Health (each served service, and the whole server, follow `ready`) and
    server reflection over all of them."""
    health = Health({OVERALL: [ready], **{service: [ready] for service in served}})
    return ServerReflection.extend([*served, health], pool=reflection_pool())
