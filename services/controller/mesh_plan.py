"""The IMEX mesh decisions for one domain (pure): mode and CA, certificates to sign, leftovers.

A domain's mode is decided once, from the controller's setting, when it is first reconciled;
a running domain never switches. Only a member with a fabric index gets a certificate (it names
the member's slot, which only that member holds). A node that is no longer a member keeps
nothing: its request and certificate are deleted (a certificate is revoked by being gone, and
each daemon trusts only its own domain's CA, which goes with the domain).
"""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from services.controller.actions import Action, DeleteMeshCredentials, SecureMesh, SignMeshCertificate
from services.controller.observed import DomainObservation


def mesh_actions(obs: DomainObservation, mutual_tls: bool, now_ms: int, grace_ms: int) -> list[Action]:
    domain = obs.domain
    out: list[Action] = []
    holders = set(obs.mesh_requests) | set(obs.mesh_certificates)
    for node in sorted(holders - set(obs.members)):
        # A request can race its own member's join in the watches: keep it for the grace period.
        request = obs.mesh_requests.get(node)
        if (
            domain is None
            or domain.deleting
            or request is None
            or now_ms - request.requested_unix_ms >= grace_ms
        ):
            out.append(DeleteMeshCredentials(node))
    if domain is None or domain.deleting:
        return out
    if domain.mesh_mode == pb.MeshMode.UNDECIDED:
        return [*out, SecureMesh(obs.domain_revision, mutual_tls)]
    if domain.mesh_mode != pb.MeshMode.MUTUAL_TLS or not obs.mesh_authority:
        return out
    for node, request in sorted(obs.mesh_requests.items()):
        member = obs.members.get(node)
        if member is None or member.lost or not member.fabric or member.index < 0:
            continue
        if obs.mesh_certificates.get(node) != request.sha256:
            out.append(SignMeshCertificate(node, request.mod_revision, member.mod_revision))
    return out
