"""Helpers for talking to the Kubernetes API that several services share."""
