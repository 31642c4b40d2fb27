"""Tests against a real Kubernetes control plane (see tools/controlplane)."""
