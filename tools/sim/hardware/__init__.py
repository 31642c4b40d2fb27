"""Simulated NVL72 hardware: the cluster description, one node's NodeHardware over it and its faults."""
