"""Real Kubernetes control plane (etcd, apiserver, controller manager, scheduler) for tests."""
