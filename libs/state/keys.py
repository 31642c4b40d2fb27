"""The key layout of the store, in one place.

<prefix>domains/<uid>                          ComputeDomain
<prefix>members/<uid>/<node>                   Member
<prefix>memberindex/<uid>/<clique>/<index>     IndexClaim (index uniqueness guard)
<prefix>nodebindings/<node>                    NodeBinding (one-domain-per-node guard)
<prefix>nodes/<node>                           Node (on the node agent's lease)
<prefix>claims/<claim uid>                     Claim (simulation claim source)
<prefix>preparations/<node>/<claim uid>        PreparedClaim
<prefix>daemons/<uid>/<node>                   DaemonStatus
<prefix>reservations/<id>                      Reservation (on a TTL lease)
<prefix>nodereservations/<node>                Reservation guard of one node (same lease)
<prefix>advisorkey                             AdvisorIdKey (the extender's reservation id key)
<prefix>election/<name>                        LeaderRecord (on the leader's lease)
<prefix>meshca/<uid>                           MeshAuthority (the domain's CA; controller only)
<prefix>meshcsr/<uid>/<node>                   MeshCertificateRequest (the node's IMEX agent)
<prefix>meshcert/<uid>/<node>                  MeshCertificate (signed by the controller)
"""

from __future__ import annotations

from dataclasses import dataclass


def _segment(value: str, what: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"invalid {what} {value!r} for a store key: empty or contains '/'")
    return value


@dataclass(frozen=True)
class Keys:
    prefix: str = "/cd/v1/"

    def domains(self) -> str:
        return f"{self.prefix}domains/"

    def domain(self, uid: str) -> str:
        return f"{self.prefix}domains/{_segment(uid, 'domain uid')}"

    def all_members(self) -> str:
        return f"{self.prefix}members/"

    def members(self, domain_uid: str) -> str:
        return f"{self.prefix}members/{_segment(domain_uid, 'domain uid')}/"

    def member(self, domain_uid: str, node: str) -> str:
        return self.members(domain_uid) + _segment(node, "node name")

    def all_member_indices(self) -> str:
        return f"{self.prefix}memberindex/"

    def member_indices(self, domain_uid: str, clique: str | None = None) -> str:
        base = f"{self.prefix}memberindex/{_segment(domain_uid, 'domain uid')}/"
        return base if clique is None else base + _segment(clique, "clique id") + "/"

    def member_index(self, domain_uid: str, clique: str, index: int) -> str:
        return self.member_indices(domain_uid, clique) + str(index)

    def node_bindings(self) -> str:
        return f"{self.prefix}nodebindings/"

    def node_binding(self, node: str) -> str:
        return self.node_bindings() + _segment(node, "node name")

    def nodes(self) -> str:
        return f"{self.prefix}nodes/"

    def node(self, name: str) -> str:
        return self.nodes() + _segment(name, "node name")

    def claims(self) -> str:
        return f"{self.prefix}claims/"

    def claim(self, uid: str) -> str:
        return self.claims() + _segment(uid, "claim uid")

    def all_preparations(self) -> str:
        return f"{self.prefix}preparations/"

    def preparations(self, node: str) -> str:
        return f"{self.prefix}preparations/{_segment(node, 'node name')}/"

    def preparation(self, node: str, claim_uid: str) -> str:
        return self.preparations(node) + _segment(claim_uid, "claim uid")

    def all_daemons(self) -> str:
        return f"{self.prefix}daemons/"

    def daemons(self, domain_uid: str) -> str:
        return f"{self.prefix}daemons/{_segment(domain_uid, 'domain uid')}/"

    def daemon(self, domain_uid: str, node: str) -> str:
        return self.daemons(domain_uid) + _segment(node, "node name")

    def reservations(self) -> str:
        return f"{self.prefix}reservations/"

    def reservation(self, reservation_id: str) -> str:
        return self.reservations() + _segment(reservation_id, "reservation id")

    def node_reservations(self) -> str:
        return f"{self.prefix}nodereservations/"

    def node_reservation(self, node: str) -> str:
        return self.node_reservations() + _segment(node, "node name")

    def advisor_id_key(self) -> str:
        return f"{self.prefix}advisorkey"

    def mesh_authorities(self) -> str:
        return f"{self.prefix}meshca/"

    def mesh_authority(self, domain_uid: str) -> str:
        return self.mesh_authorities() + _segment(domain_uid, "domain uid")

    def all_mesh_requests(self) -> str:
        return f"{self.prefix}meshcsr/"

    def mesh_requests(self, domain_uid: str) -> str:
        return f"{self.prefix}meshcsr/{_segment(domain_uid, 'domain uid')}/"

    def mesh_request(self, domain_uid: str, node: str) -> str:
        return self.mesh_requests(domain_uid) + _segment(node, "node name")

    def all_mesh_certificates(self) -> str:
        return f"{self.prefix}meshcert/"

    def mesh_certificates(self, domain_uid: str) -> str:
        return f"{self.prefix}meshcert/{_segment(domain_uid, 'domain uid')}/"

    def mesh_certificate(self, domain_uid: str, node: str) -> str:
        return self.mesh_certificates(domain_uid) + _segment(node, "node name")

    def election(self, name: str) -> str:
        return f"{self.prefix}election/{_segment(name, 'election name')}"

    @staticmethod
    def last_segment(key: str) -> str:
        return key.rsplit("/", 1)[-1]
