"""The controller's Kubernetes adapter: ComputeDomain CRs <-> the store, the workload RCT, events, sweep."""
