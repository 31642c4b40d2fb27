"""The state store: the protobuf state model kept in etcd."""
