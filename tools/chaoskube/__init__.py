"""The chaos soak in Kubernetes mode (real kubelets, the API server): `python -m tools.chaoskube`."""
