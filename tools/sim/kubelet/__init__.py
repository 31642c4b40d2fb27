"""Real kubelets for simulated nodes: the upstream kubelet, one per node, on crisim (the simulated
container runtime of tools/controlplane/node/crisim), each in a private mount namespace."""
