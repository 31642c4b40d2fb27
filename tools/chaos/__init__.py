"""Chaos soak: random jobs and real faults on a cdsim cluster, with the SPEC §4 invariants checked
all along (`python -m tools.chaos --duration S --seed N`)."""
